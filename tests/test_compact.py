"""The compact optimizer state (optim.state 8bit): quantization error bounds, the native kernel against
its torch reference, one step against torch.optim.AdamW, the store's bytes, checkpoints bit for bit,
and a run through the real Ray pipeline resumed from a checkpoint."""

import glob
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from megatrain_ray import cli
from megatrain_ray.config import ModelConfig, OptimConfig, load_config
from megatrain_ray.engine import adamw_native, compact, optim
from megatrain_ray.engine.store.host_store import ParameterStore, StoreSpec, grad_slots_for
from megatrain_ray.errors import ConfigError
from megatrain_ray.io import checkpoint, writer
from megatrain_ray.model.layout import StoreLayout
from megatrain_ray.model.precision import Precision
from megatrain_ray.orchestration.pipeline import train

from artifacts import read_tensors

C = compact
native_only = pytest.mark.skipif(adamw_native.compact_kernel() is None, reason="no C compiler: no native kernel")


def _wide(n: int, seed: int = 0) -> torch.Tensor:
    """[n] fp32 with magnitudes spread over 2^-30 .. 1 (and some exact zeros) in every block."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp2(-30 * torch.rand(n, generator=gen))
    x[::97] = 0.0
    return x


@pytest.mark.parametrize("signed", [True, False])
def test_quantization_round_trip_error_is_within_one_code_step_and_unbiased(signed):
    n = 3 * C.BLOCK + 517  # a partial last block
    x = _wide(n) if signed else _wide(n).abs()
    mb = C.M_BITS if signed else C.S_BITS
    keys = range(64)
    outs = torch.stack([C.dequantize(*C.quantize(x, C.random_bits(torch.arange(n), k)[1], signed), signed)
                        for k in keys])
    scale = C.absmax(x).repeat_interleave(C.BLOCK)[:n]
    in_range = x.abs() >= scale * 2.0 ** C.MIN_EXP
    err = (outs - x).abs()
    # A value in [2^e, 2^(e+1)) of the block scale is rounded to one of the two codes around it, which are
    # 2^(e - mb) apart: |error| < 2^-mb |x|; the scale multiply and r = |x| / scale add ~2^-23 relative.
    assert (err[:, in_range] <= x.abs()[in_range] * (2.0 ** -mb + 2.0 ** -20)).all()
    # Below 2^MIN_EXP of the scale a value becomes zero or the smallest code (2^MIN_EXP x scale).
    assert (outs[:, ~in_range].abs() <= (scale * 2.0 ** C.MIN_EXP * (1 + 2.0 ** -20))[~in_range]).all()
    # Signs are kept, and each block's absmax element is exact.
    assert ((outs * x) >= 0).all()
    top = torch.stack([b.abs().argmax() + i * C.BLOCK for i, b in enumerate(x.split(C.BLOCK))])
    assert torch.equal(outs[0, top], x[top])
    # Unbiased: each draw's error is within one step, so the mean of K draws has std <= step / (2 sqrt K).
    mean_err = (outs.mean(0) - x)[in_range]
    step = x.abs()[in_range] * 2.0 ** -mb
    assert (mean_err.abs() <= 5 * step / (2 * len(keys) ** 0.5) + x.abs()[in_range] * 2.0 ** -20).all()
    # ... whereas the error of one draw is typically a sizeable part of the step.
    assert err[0, in_range].mean() > 0.1 * step.mean()


def test_stochastic_bf16_rounding_is_one_of_the_two_neighbours_and_unbiased():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    down = x.to(torch.bfloat16)  # nearest; the two neighbours are it and the next one towards x
    draws = torch.stack([C.round_bf16(x, C.random_bits(torch.arange(4096), k)[0]).float() for k in range(64)])
    lo = torch.minimum(down.float(), draws.min(0).values)
    hi = torch.maximum(down.float(), draws.max(0).values)
    assert (hi - lo <= x.abs() * 2.0 ** -7).all()  # at most one bf16 ulp apart
    ulp = x.abs() * 2.0 ** -7
    assert ((draws.mean(0) - x).abs() <= 5 * ulp / (2 * 8)).all()


@native_only
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_native_kernel_equals_the_torch_reference_bit_for_bit(grad_dtype, monkeypatch):
    """Both use only correctly rounded fp32 operations in the same order (no FMA: -ffp-contract=off), so
    every weight, code and scale is the same, over several steps, pieces and threads."""
    monkeypatch.setattr(optim, "CHUNK", 2 * C.BLOCK)  # several pieces per unit, on 3 threads
    n, decay = 5 * C.BLOCK + 300, 7000  # the decay boundary inside a block
    cfg = OptimConfig(lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95)
    gen = torch.Generator().manual_seed(0)
    start = (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16)
    states = []
    for use_native in (True, False):
        master, qm, qv = start.clone(), torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
        sm, sv = torch.zeros(C.num_blocks(n)), torch.zeros(C.num_blocks(n))
        runner = optim.AdamWRunner(3, native=use_native)
        g = torch.Generator().manual_seed(1)
        for step in range(1, 5):
            grad = (torch.randn(n, generator=g) * torch.exp2(-20 * torch.rand(n, generator=g))).to(grad_dtype)
            runner.update_compact(master, grad, qm, qv, sm, sv, None, decay, 2, step, cfg.lr, cfg, grad_scale=0.7)
        runner.close()
        states.append((master.view(torch.int16), qm, qv, sm, sv))
    for a, b in zip(*states):
        assert torch.equal(a, b)
    assert (states[0][1] != 0).float().mean() > 0.9  # the state is really populated


def _reference_step(p: torch.Tensor, grad: torch.Tensor, opt_state, cfg: OptimConfig, step: int):
    """torch.optim.AdamW from weights p (fp32), one step; returns (new weights, exp_avg, exp_avg_sq)."""
    param = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([param], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=0.0)
    if opt_state is not None:
        opt.state[param] = {"step": torch.tensor(float(step - 1)), "exp_avg": opt_state[0].clone(),
                            "exp_avg_sq": opt_state[1].clone()}
    param.grad = grad.clone()
    opt.step()
    st = opt.state[param]
    return param.detach(), st["exp_avg"], st["exp_avg_sq"]


def test_compact_steps_stay_within_the_argued_bound_of_exact_adamw():
    n = 4 * C.BLOCK
    cfg = OptimConfig(lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.0)
    gen = torch.Generator().manual_seed(3)
    master = (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16)
    qm, qv = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    sm, sv = torch.zeros(C.num_blocks(n)), torch.zeros(C.num_blocks(n))
    runner = optim.AdamWRunner(2)
    g1, g2 = (torch.randn(n, generator=gen) * torch.exp2(-8 * torch.rand(n, generator=gen)) for _ in range(2))

    # Step 1 from a zero state: the moments decode exactly (zero), so the update is AdamW's; only the new
    # weight is rounded to bf16, stochastically, to one of its two neighbours: within one bf16 ulp
    # (2^-7 |p|), plus fp32 ulps of another operation order (1e-7 relative).
    ref1, m1, v1 = _reference_step(master.float(), g1, None, cfg, 1)
    runner.update_compact(master, g1, qm, qv, sm, sv, None, n, 0, 1, cfg.lr, cfg)
    diff = master.float() - ref1
    assert (diff.abs() <= ref1.abs() * 2.0 ** -7 + 1e-9).all()
    assert diff.abs().max() > 0  # it really rounded
    assert abs(float(diff.mean())) <= 5 * float(ref1.abs().mean()) * 2.0 ** -8 / n ** 0.5  # and without bias

    # Step 2 from the quantized state, the same weights in both: m1 is carried within 2^-3 |m1| (+ 2^-14 of
    # its block's max when flushed) and sqrt(v1) within 2^-4 of itself (+ 2^-14 of the max); the update
    # lr m2 / (sqrt(v2) + eps) (bias-corrected) moves by at most what those bounds allow, elementwise.
    start = master.float().clone()
    ref2, _, _ = _reference_step(start, g2, (m1, v1), cfg, 2)
    runner.update_compact(master, g2, qm, qv, sm, sv, None, n, 0, 2, cfg.lr, cfg)
    b1, b2 = cfg.beta1, cfg.beta2
    flush_m = (m1.abs().view(-1, C.BLOCK).amax(1) * 2.0 ** C.MIN_EXP).repeat_interleave(C.BLOCK)
    s1 = v1.sqrt()
    flush_s = (s1.view(-1, C.BLOCK).amax(1) * 2.0 ** C.MIN_EXP).repeat_interleave(C.BLOCK)
    dm = b1 * (m1.abs() * 2.0 ** -3 + flush_m)
    ds = s1 * 2.0 ** -4 + flush_s
    dv = b2 * (2 * s1 * ds + ds * ds)
    m2 = b1 * m1 + (1 - b1) * g2
    v2 = b2 * v1 + (1 - b2) * g2 * g2
    bc1, bc2 = 1 - b1 ** 2, (1 - b2 ** 2) ** 0.5
    d = v2.sqrt() / bc2 + cfg.eps
    d_min = (v2 - dv).clamp_min(0).sqrt() / bc2 + cfg.eps
    d_max = (v2 + dv).sqrt() / bc2 + cfg.eps
    du = cfg.lr / bc1 * (dm / d_min + m2.abs() * (d_max - d_min) / (d_min * d))
    err = (master.float() - ref2).abs()
    assert (err <= du + ref2.abs() * 2.0 ** -7 + 1e-9).all()
    # The bound is not vacuous: it is well below the update itself for most elements ...
    upd = (ref2 - start).abs()
    assert float((du < 0.5 * upd).float().mean()) > 0.9
    # ... and the compact step is much closer to AdamW's than to not updating at all.
    assert float((master.float() - ref2).norm()) < 0.2 * float(upd.norm())
    runner.close()


def _cfg(shm_dir, run_dir, *extra):
    return load_config(None, [f"memory.shm_dir={shm_dir}", f"train.run_dir={run_dir}", "compute.device=cpu",
                              "train.steps=6", "train.seq_len=32", "train.micro_batch_size=4", "optim.warmup_steps=2",
                              "optim.weight_decay=0.1", "optim.state=8bit", "cluster.actor_timeout_s=120", *extra])


def test_store_bytes_per_parameter_of_each_mode():
    """Bytes of the store per parameter on a GPU run (bf16 compute), for a 1B-class shape: exact fp32
    master 14; bf16 master 12 with clipping (its gradient array), 10 without; compact 6 and 4."""
    model = ModelConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
                        num_key_value_heads=4, vocab_size=32000)
    n = StoreLayout.build(model).num_params
    per = {}
    for name, precision in {"fp32": Precision(torch.float32, torch.bfloat16),
                            "bf16": Precision(torch.bfloat16, torch.bfloat16),
                            "8bit": Precision(torch.bfloat16, torch.bfloat16, optim_state=torch.uint8)}.items():
        for clip in (1.0, 0.0):
            spec = StoreSpec(model, precision, "/dev/shm", 0, "x", grad_slots=grad_slots_for(precision, clip))
            ring = spec.numel("grad") * 2 if spec.grad_slots else 0  # O(one unit), not per parameter
            per[name, clip] = (spec.nbytes() - ring) / n
    expected = {("fp32", 1.0): 14, ("fp32", 0.0): 14, ("bf16", 1.0): 12, ("bf16", 0.0): 10,
                ("8bit", 1.0): 6, ("8bit", 0.0): 4}
    for key, value in expected.items():
        # padding of units to 4096 elements and the block scales (8 / 2048 bytes) on top
        assert value <= per[key] <= value + 0.01, (key, per[key])


def test_checkpoint_round_trip_of_the_compact_state_is_bit_exact(shm_dir, tmp_path):
    cfg = _cfg(shm_dir, tmp_path, "model.num_hidden_layers=2")
    precision = Precision(torch.bfloat16, torch.float32, optim_state=torch.uint8)
    src = ParameterStore(StoreSpec(cfg.model, precision, shm_dir, os.getpid(), "src"), seed=0)
    dst = ParameterStore(StoreSpec(cfg.model, precision, shm_dir, os.getpid(), "dst"), seed=1)
    fp32 = ParameterStore(StoreSpec(cfg.model, Precision(torch.float32, torch.float32), shm_dir, os.getpid(), "f"), 0)
    try:
        gen = torch.Generator().manual_seed(0)
        for kind in ("exp_avg", "exp_avg_sq"):
            src.store.arrays[kind].copy_(torch.randint(0, 256, src.store.arrays[kind].shape, generator=gen))
        for kind in ("exp_avg_scale", "exp_avg_sq_scale"):
            src.store.arrays[kind].copy_(torch.rand(src.store.arrays[kind].shape, generator=gen))
        for i in range(len(src.store.layout.units)):
            src.store.set_version(i, 3)
        path = writer.save(src.store, str(tmp_path / "ckpts"), 3, {"train": {"seed": 0}}, "run")
        tensors = {}
        for f in glob.glob(os.path.join(path, "optimizer*.safetensors")):
            tensors.update(load_file(f))
        units = src.store.layout.units
        assert set(tensors) == {f"{k}.{u}" for u in units for k in checkpoint.COMPACT_KINDS}
        assert tensors["exp_avg.layers.0"].dtype == torch.uint8
        assert json.load(open(os.path.join(path, "meta.json")))["precision"]["optim_state"] == "8bit"
        assert checkpoint.load_into(dst.store, path) == 3
        for kind in src.store.arrays:
            for i in range(len(units)):
                a, b = ((s.store.scale_block(kind, i) if kind.endswith("_scale") else s.store.block(kind, i))
                        for s in (src, dst))
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (kind, i)
        with pytest.raises(ConfigError, match="holds the 8bit optimizer state but the run has optim.state=fp32"):
            checkpoint.load_into(fp32.store, path)
    finally:
        for s in (src, dst, fp32):
            s.close()




@pytest.mark.slow  # three Ray runs
def test_compact_run_through_ray_trains_exports_bf16_and_resumes_bit_for_bit(ray_cluster, shm_dir, tmp_path):
    a = train(_cfg(shm_dir, tmp_path / "a", "train.checkpoint_every=3", "train.keep_checkpoints=3"),
              log=lambda line: None)
    fp32 = train(_cfg(shm_dir, tmp_path / "f", "optim.state=fp32", "train.save_final=false",
                      "train.checkpoint_every=0"), log=lambda line: None)
    assert a.losses[-1] < a.losses[0] - 0.5
    # Compact vs exact over 6 steps: the same trajectory to within a few tenths of a percent.
    np.testing.assert_allclose(a.losses, fp32.losses, rtol=5e-3)
    assert a.losses != fp32.losses
    final = read_tensors(a.final_dir)
    assert {v.dtype for v in final.values()} == {torch.bfloat16}  # the export is the bf16 master
    step3 = os.path.join(a.run_dir, "checkpoints", "step-000003")
    assert cli.main(["train", "--resume", step3]) == 0
    c_run = next(d for d in glob.glob(str(tmp_path / "a" / "*")) if d != a.run_dir)
    final_c = read_tensors(os.path.join(c_run, "final"))
    assert final.keys() == final_c.keys() and all(torch.equal(final[k], final_c[k]) for k in final)
    end_a, end_c = (read_tensors(os.path.join(r, "checkpoints", "step-000006")) for r in (a.run_dir, c_run))
    assert end_a.keys() == end_c.keys() and all(torch.equal(end_a[k], end_c[k]) for k in end_a)
    assert os.listdir(shm_dir) == []


def test_optim_state_is_validated_with_the_key_named():
    with pytest.raises(ConfigError, match="optim.state"):
        load_config(None, ["optim.state=4bit"])


@pytest.mark.parametrize("state", ["fp32", "8bit"])
def test_gradients_held_for_the_norm_train_exactly_as_the_host_gradient_array(state, shm_dir, tmp_path):
    """bf16 master (or the compact state) with clipping: experimental.hold_grads keeps the step's gradients on
    the device until the norm is known and sends them through a ring of 3 unit slots in update order,
    instead of a whole-model host gradient array. The same gradients, the same norm (summed in the same
    order) and the same updates: losses and norms bit for bit; the store is 2 bytes per parameter smaller."""
    from megatrain_ray.orchestration.local import train_local
    from megatrain_ray.orchestration.preflight import memory_plan

    base = [f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path}", "train.steps=4", "compute.device=cpu",
            "precision.compute_dtype=bfloat16", "precision.master_dtype=bfloat16", f"optim.state={state}",
            "model.num_hidden_layers=3"]
    runs = {hold: train_local(load_config(None, base + [f"experimental.hold_grads={hold}"]), 0) for hold in ("false", "true")}
    got = {hold: [(r["loss"], r["grad_norm"]) for r in rows] for hold, rows in runs.items()}
    assert got["true"] == got["false"]
    assert min(n for _, n in got["true"]) > 1.0  # clipping was active (optim.max_grad_norm 1)
    plans = {hold: memory_plan(load_config(None, base + [f"experimental.hold_grads={hold}"]), "cpu", starts_ray=False)
             for hold in ("false", "true")}
    n = StoreLayout.build(load_config(None, base).model).num_params
    grads = {h: sum(r.nbytes for r in p.rows if r.component.startswith("gradients (host side)")) for h, p in plans.items()}
    held = [r for r in plans["true"].rows if r.component.startswith("the step's gradients, held")]
    assert grads["false"] >= 2 * n and grads["true"] < grads["false"] and len(held) == 1 and held[0].nbytes == 2 * n


def test_plan_shows_bytes_per_parameter_and_the_largest_model_of_each_mode(capsys):
    cfg = load_config(None, ["model.hidden_size=5120", "model.intermediate_size=27648", "model.num_hidden_layers=4",
                             "model.num_attention_heads=40", "model.num_key_value_heads=8", "model.vocab_size=152064"])
    from megatrain_ray.orchestration.store_modes import bytes_per_param, mode_notes

    per = {m: bytes_per_param(cfg, "cuda", s, m2) for m, (s, m2) in
           {"fp32": ("fp32", "float32"), "bf16": ("fp32", "bfloat16"), "8bit": ("8bit", "bfloat16")}.items()}
    # On cuda the gradients wait on the GPU for the norm, so clipping costs no host bytes.
    assert per["fp32"] == pytest.approx(14, abs=0.01) and per["bf16"] == pytest.approx(10, abs=0.01)
    assert per["8bit"] == pytest.approx(4, abs=0.01)
    lines = mode_notes(cfg, "cuda", 120 * 2**30)
    assert "compact (optim.state 8bit)" in lines[-4] and " 4.00 B/param  -> 32.2B parameters" in lines[-4]
    # LoRA: the frozen base in bf16 alone, whatever the optimizer settings (its adapters are on the GPU)
    assert lines[-3].startswith("  LoRA") and " 2.00 B/param  -> 64.0B parameters (128 layer(s)" in lines[-3]
    # and in each quantized format of the base (lora.base_format): the layers' bytes decide how many fit
    assert "int8)" in lines[-2] and "(257 layer(s) of this shape, 1.00" in lines[-2]
    assert "nf4)" in lines[-1] and "(499 layer(s) of this shape, 0.516 B/param in the layers" in lines[-1]
    assert cli.main(["plan", "--device", "cuda", "--gpu-memory", "141", "--set", "optim.state=8bit"]) in (0, 2)
    assert "compact (optim.state 8bit)" in capsys.readouterr().out


@native_only
def test_bf16_master_is_rounded_stochastically_the_same_way_by_both_kernels():
    """optim.state fp32 with precision.master_dtype bfloat16: the fp32 update of AdamW, then the weight is
    one of the two bf16 neighbours of the exact result (one ulp apart), chosen by the same random bits
    in the C kernel and in the torch fallback: bit for bit the same."""
    n, cfg = 5000, OptimConfig(lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    start, grad = torch.randn(n, generator=gen).to(torch.bfloat16), torch.randn(n, generator=gen).to(torch.bfloat16)
    outs = []
    for use_native in (True, False):
        master, m, v = start.clone(), torch.zeros(n), torch.zeros(n)
        runner = optim.AdamWRunner(2, native=use_native)
        runner.update(master, grad, m, v, None, 3000, 1, cfg.lr, cfg, 0.5, unit=3)
        runner.close()
        outs.append(master)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    exact = start.float().clone()
    param = torch.nn.Parameter(exact)
    opt = torch.optim.AdamW([{"params": [param]}], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                            weight_decay=0.0)
    param.data[:3000].mul_(1 - cfg.lr * cfg.weight_decay)  # decoupled decay of the matrices' span only
    param.grad = grad.float() * 0.5
    opt.step()
    ref = param.detach()
    assert ((outs[0].float() - ref).abs() <= ref.abs() * 2.0 ** -7 + 1e-6).all()
    assert (outs[0] != ref.to(torch.bfloat16)).any()  # not round-to-nearest everywhere
