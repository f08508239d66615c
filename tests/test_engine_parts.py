"""The engine's parts without Ray: layout and fused views, the per-unit AdamW, fetch order,
and the bf16 precision modes through the single-process driver (the same roles as a Ray run)."""

import os

import numpy as np
import pytest
import torch

from megatrain_ray.config import ModelConfig, OptimConfig, load_config
from megatrain_ray.engine import adamw_native, optim
from megatrain_ray.errors import Diverged
from megatrain_ray.engine.schedule import COMPUTE, SINK, Schedule
from megatrain_ray.model import transformer as M
from megatrain_ray.model.layout import UNIT_ALIGN, LayerTemplate, StoreLayout

SMALL_MODEL = ["model.hidden_size=64", "model.intermediate_size=176", "model.num_hidden_layers=3",
               "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=512"]
"""A 3-layer model of 0.2M parameters for the single-process runs below."""


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_fused_views_are_the_concatenated_parameters_and_change_nothing(model_type):
    cfg = ModelConfig(model_type=model_type, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=192)
    t = LayerTemplate.build(cfg, "layers.0")
    flat = torch.randn(t.numel, dtype=torch.float64)
    p = t.bind(flat, fused=True)
    assert "mlp.gate_up_proj.weight" in p and "self_attn.qkv_proj.weight" in p
    assert torch.equal(p["mlp.gate_up_proj.weight"], torch.cat([p["mlp.gate_proj.weight"], p["mlp.up_proj.weight"]]))
    qkv = torch.cat([p[f"self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(p["self_attn.qkv_proj.weight"], qkv)
    if model_type == "qwen2":
        assert torch.equal(p["self_attn.qkv_proj.bias"], torch.cat([p[f"self_attn.{n}_proj.bias"] for n in "qkv"]))
    x = torch.randn(2, 16, 128, dtype=torch.float64)
    rope = M.rope_cache(cfg, 16, torch.device("cpu"), torch.float64)
    fused = M.decoder_layer(p, x, rope, cfg)
    plain = M.decoder_layer(t.bind(flat, fused=False), x, rope, cfg)
    torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_grouped_projections_accept_any_concatenation_and_need_none(model_type):
    """The model's contract, without the layout: params with the members only, or with a concatenation
    built by torch.cat (no flat buffer anywhere), give the same layer output and the same gradients of
    the members (through the concatenation when it is there)."""
    cfg = ModelConfig(model_type=model_type, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=96)
    gen = torch.Generator().manual_seed(0)
    members = {name: torch.randn(shape, generator=gen, dtype=torch.float64) * 0.1
               for name, shape in M.unit_params(cfg, "layers.0")}
    x = torch.randn(2, 8, 64, generator=gen, dtype=torch.float64)
    rope = M.rope_cache(cfg, 8, torch.device("cpu"), torch.float64)

    def grads(concatenate: bool):
        leaves = {k: v.clone().requires_grad_(True) for k, v in members.items()}
        p = dict(leaves)
        if concatenate:
            for group, parts in M.PROJECTION_GROUPS.items():
                for suffix in ("weight", "bias"):
                    if f"{parts[0]}.{suffix}" in p:
                        p[f"{group}.{suffix}"] = torch.cat([leaves[f"{m}.{suffix}"] for m in parts])
        y = M.decoder_layer(p, x, rope, cfg)
        return y, torch.autograd.grad(y.square().sum(), list(leaves.values()))

    (y0, g0), (y1, g1) = grads(False), grads(True)
    torch.testing.assert_close(y1, y0, rtol=1e-12, atol=1e-12)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_store_layout_is_page_aligned_and_counts_parameters():
    cfg = ModelConfig(vocab_size=300, hidden_size=64, num_hidden_layers=3)
    layout = StoreLayout.build(cfg)
    assert layout.units == ("embed", "layers.0", "layers.1", "layers.2", "head")
    assert all(o % UNIT_ALIGN == 0 for o in layout.offsets)
    per_layer = 4 * 64 * 64 + 3 * 64 * 176 + 2 * 64
    assert layout.num_params == 2 * 300 * 64 + 3 * per_layer + 64
    # matrices first: everything past decay_numel is 1-D
    t = layout.templates[1]
    assert all(len(shape) == 1 for _, shape, off in t.params if off >= t.decay_numel)


def test_a_configs_layouts_are_built_once_and_equal_a_fresh_build():
    """StoreLayout, a quantized base's and the adapters' layouts are built once per config and shared
    (planning asks for them hundreds of times); each equals a fresh build, and another config gets its own."""
    from megatrain_ray.config import LoraSection
    from megatrain_ray.model.lora import AdapterLayout
    from megatrain_ray.model.quant_layout import QuantLayout

    cfg = ModelConfig(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2)
    same = ModelConfig(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2)
    deeper = ModelConfig(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2)
    lora = LoraSection(rank=4, target_modules=("q_proj", "v_proj"))
    for build, fresh in ((lambda c: StoreLayout.build(c), lambda c: StoreLayout._build(c)),
                         (lambda c: QuantLayout.build(c, "nf4", torch.bfloat16),
                          lambda c: QuantLayout._build(c, "nf4", torch.bfloat16)),
                         (lambda c: AdapterLayout.build(c, lora), lambda c: AdapterLayout._build(c, lora))):
        assert build(cfg) is build(same) == fresh(cfg)
        assert build(deeper) is not build(cfg) and build(deeper) == fresh(deeper) != fresh(cfg)


def _layout(layers: int, tied: bool) -> StoreLayout:
    return StoreLayout.build(ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                         tie_word_embeddings=tied))


def test_fetch_order_streams_each_layer_twice():
    assert Schedule.build(_layout(4, False), tied=False).fetch == (0, 1, 2, 3, 4, 5, 4, 3, 2, 1)
    assert Schedule.build(_layout(2, True), tied=True).fetch == (0, 1, 2, 3, 0, 2, 1)


def test_units_are_records_and_resident_units_are_neither_fetched_nor_the_sinks():
    layout = _layout(3, False)
    assert [(u.name, u.kind, u.layer) for u in layout.records] == [
        ("embed", "embedding", None), ("layers.0", "decoder_layer", 0), ("layers.1", "decoder_layer", 1),
        ("layers.2", "decoder_layer", 2), ("head", "head", None)]
    assert (layout.embed.index, layout.head.index, [u.index for u in layout.layers]) == (0, 4, [1, 2, 3])
    schedule = Schedule.build(layout, tied=False, resident=(0, 1, 4))
    assert schedule.fetch == (2, 3, 3, 2)
    assert schedule.update == (0, 1, 2, 3, 4) and schedule.sink_updates == (2, 3)
    assert [schedule.owner(u) for u in schedule.update] == [COMPUTE, COMPUTE, SINK, SINK, COMPUTE]


@pytest.mark.parametrize("decay_all", [False, True])
@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("master_dtype", [torch.float32, torch.bfloat16])
def test_unit_update_matches_torch_adamw(master_dtype, native, decay_all, monkeypatch):
    """Chunked update with a bf16 gradient, clipping factor and stream refresh vs torch.optim.AdamW,
    with torch's kernels and with the one-pass C kernel on a pool of threads; the unit's matrices and
    its 1-D tail are two parameters of the reference, the tail decayed with decay_norms_and_biases."""
    if native and adamw_native.kernel() is None:
        pytest.skip("no C compiler: the native AdamW kernel cannot be built here")
    monkeypatch.setattr(optim, "CHUNK", 1000)  # several pieces, and a piece across the decay boundary
    n, decay = 5000, 3100
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.99, decay_norms_and_biases=decay_all)
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(n, generator=gen).to(master_dtype)
    master, m, v = start.clone(), torch.zeros(n), torch.zeros(n)
    stream = torch.empty(n, dtype=torch.bfloat16)
    matrices, rest = (torch.nn.Parameter(part.float().clone()) for part in start.split([decay, n - decay]))
    opt = torch.optim.AdamW([{"params": [matrices], "weight_decay": cfg.weight_decay},
                             {"params": [rest], "weight_decay": cfg.weight_decay if decay_all else 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.99), eps=cfg.eps)
    for step in range(1, 4):
        grad = torch.randn(n, generator=gen).to(torch.bfloat16)
        stream.copy_(grad)  # the gradient lives in the stream block, as in the store
        update = optim.AdamWRunner(3, native=native).update
        update(master, stream, m, v, stream, decay, step, cfg.lr, cfg, grad_scale=0.5)
        matrices.grad, rest.grad = (grad.float() * 0.5).split([decay, n - decay])
        opt.step()
        ref = torch.cat([matrices.detach(), rest.detach()])
        if master_dtype == torch.float32:
            # Elementwise, the same formula in another order: each step can move the rounding of an
            # element by one ulp (|x| ulps <= 1.2e-7 |x|), so 3 steps stay within rtol 1e-6; atol covers
            # elements near zero, whose error is an ulp of the update (lr 1e-2), far below 1e-7.
            torch.testing.assert_close(master, ref, rtol=1e-6, atol=1e-7)
        else:  # bf16 master: the same update, rounded to bf16 each step
            torch.testing.assert_close(master.float(), ref, rtol=2e-2, atol=2e-2)
            matrices.data.copy_(master[:decay].float())
            rest.data.copy_(master[decay:].float())
        assert torch.equal(stream, master.to(torch.bfloat16))


def test_every_update_path_clips_as_torch_and_refuses_a_norm_that_is_not_finite():
    # torch's clip_grad_norm_ factor: max_norm / (norm + 1e-6), capped at 1; 0 turns clipping off.
    grads = [torch.full((3,), 2.0), torch.full((4,), -1.0)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    coef = optim.step_clipping(4, float(torch.cat(grads).norm()), 1.0)
    assert coef < 1 and all(torch.equal(p.grad, g * coef) for p, g in zip(params, grads))
    assert optim.step_clipping(4, 0.5, 1.0) == 1.0 and optim.step_clipping(4, 1e9, 0.0) == 1.0
    for bad in (float("inf"), float("nan")):
        with pytest.raises(Diverged, match=rf"^the gradient norm of step 5 is {bad}; training diverged, "
                                                 r"lower optim.lr or check the data.$"):
            optim.step_clipping(4, bad, 1.0)


def test_whole_span_update_of_owned_units_matches_torch_adamw():
    """adamw_unit as the compute worker runs it on a GPU for the units it owns (memory.resident):
    one call per decay span, an fp32 gradient scaled in place, the compute-dtype copy refreshed; the
    same tolerance and argument as the piecewise update above."""
    n, decay = 5000, 3100
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.99)
    gen = torch.Generator().manual_seed(2)
    start = torch.randn(n, generator=gen)
    master, m, v, weights = start.clone(), torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)
    matrices, rest = (torch.nn.Parameter(part.clone()) for part in start.split([decay, n - decay]))
    opt = torch.optim.AdamW([{"params": [matrices], "weight_decay": cfg.weight_decay},
                             {"params": [rest], "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.99), eps=cfg.eps)
    for step in range(1, 4):
        grad = torch.randn(n, generator=gen)
        optim.adamw_unit(master, grad.clone(), m, v, weights, decay, step, cfg.lr, cfg, grad_scale=0.5, pieces=False)
        matrices.grad, rest.grad = (grad * 0.5).split([decay, n - decay])
        opt.step()
        torch.testing.assert_close(master, torch.cat([matrices.detach(), rest.detach()]), rtol=1e-6, atol=1e-7)
        assert torch.equal(weights, master.to(torch.bfloat16))


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_split_update_is_the_one_pass_update_bit_for_bit(grad_dtype, monkeypatch):
    """The sink's two passes (moments and stream copy first, master later) give exactly the one-pass
    kernel's master, moments and stream copy: the same operations in the same order. The first pass
    leaves the master as it was (a checkpoint in between still sees the boundary's master)."""
    runner = optim.AdamWRunner(3)
    if runner.split is None:
        pytest.skip("no C compiler: the native AdamW kernel cannot be built here")
    monkeypatch.setattr(optim, "CHUNK", 1000)
    n, decay = 5000, 3100
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.99)
    gen = torch.Generator().manual_seed(1)
    one = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2, torch.rand(n, generator=gen) * 1e-4]
    two = [t.clone() for t in one]
    for step in range(1, 4):
        grad = torch.randn(n, generator=gen).to(grad_dtype)
        s1, s2 = (grad.clone() if grad_dtype == torch.bfloat16 else torch.zeros(n, dtype=torch.bfloat16)
                  for _ in range(2))
        g1, g2 = (s1, s2) if grad_dtype == torch.bfloat16 else (grad.clone(), grad.clone())  # may alias the copy
        runner.update(one[0], g1, one[1], one[2], s1, decay, step, cfg.lr, cfg, grad_scale=0.7)
        assert runner.splits(two[0], g2, s2)
        before = two[0].clone()
        runner.update_stream(two[0], g2, two[1], two[2], s2, decay, step, cfg.lr, cfg, grad_scale=0.7)
        assert torch.equal(two[0], before)
        assert torch.equal(s2.view(torch.int16), s1.view(torch.int16))
        runner.update_master(two[0], two[1], two[2], decay, step, cfg.lr, cfg)
        for a, b in zip(one, two):
            assert torch.equal(a, b)
        assert not torch.equal(two[0], before)
    runner.close()


def test_split_update_trains_bit_for_bit_as_one_pass(shm_dir, tmp_path, monkeypatch):
    """The two-pass update through the single-process driver (fp32 master, bf16 stream copy,
    clipping: where the resolved run chooses it) against the same run with the one-pass optimizer
    put in its place: the same losses, and the same master weights and moments in the store at the
    end (read just before the run removes it), bit for bit; and the second passes really ran."""
    from megatrain_ray.engine.store import shm
    from megatrain_ray.orchestration import local, resolve

    if adamw_native.kernel() is None:
        pytest.skip("no C compiler: the native AdamW kernel cannot be built here")
    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(0).integers(0, 512, size=20_000))
    states: dict[str, dict[str, bytes]] = {}
    remove = shm.remove_run

    def remove_run(shm_dir, owner_pid, run_id):
        states[split] = {os.path.basename(f).rsplit("-", 1)[-1]: open(f, "rb").read()
                         for f in shm.run_segments(shm_dir, owner_pid, run_id)}
        return remove(shm_dir, owner_pid, run_id)

    monkeypatch.setattr(local.shm, "remove_run", remove_run)
    chosen = resolve.host_optimizer
    losses = {}
    for split in ("true", "false"):
        monkeypatch.setattr(resolve, "host_optimizer", chosen if split == "true" else
                            lambda compact, splits: chosen(compact, False))
        cfg = load_config(None, [
            *SMALL_MODEL,
            "train.seq_len=32", "train.micro_batch_size=2", "train.num_micro_batches=2", "train.steps=4",
            f"data.path={data}", "compute.device=cpu", "precision.compute_dtype=bfloat16", "optim.weight_decay=0.1",
            "optim.max_grad_norm=0.05", f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path}"])
        rows = local.train_local(cfg, 0)
        masters = sum(1 for r in rows for lane, label, *_ in r["intervals"] if lane == "adamw" and label.endswith("master"))
        assert masters == (3 * (3 + 2) if split == "true" else 0)  # steps 1-3's, reported with the next step
        assert any(r["grad_norm"] > 0.05 for r in rows)  # clipped
        losses[split] = [r["loss"] for r in rows]
    assert losses["true"] == losses["false"]
    assert {"master", "exp_avg", "exp_avg_sq", "versions"} <= set(states["true"]) == set(states["false"])
    for kind in ("master", "exp_avg", "exp_avg_sq", "stream", "versions"):
        assert states["true"][kind] == states["false"][kind], kind


@pytest.fixture(scope="module")
def fp32_losses(shm_dirs, tmp_path_factory):
    """optim overrides -> the per-step losses of the fp32 run they are compared with (computed once)."""
    runs: dict[tuple[str, ...], list[float]] = {}

    def losses(overrides: list[str]) -> list[float]:
        key = tuple(overrides)
        if key not in runs:
            with shm_dirs() as shm_dir:
                runs[key] = _local_losses(overrides, shm_dir, tmp_path_factory.mktemp("fp32"))
        return runs[key]

    return losses


def _local_losses(overrides: list[str], shm_dir: str, run_dir) -> list[float]:
    """The default model for 4 steps on the CPU, through the single-process driver (the same roles as a
    Ray run, without Ray: the precision modes are the engine's, not the orchestration's)."""
    from megatrain_ray.orchestration.local import train_local

    base = [f"memory.shm_dir={shm_dir}", f"train.run_dir={run_dir}", "train.steps=4", "compute.device=cpu"]
    return [row["loss"] for row in train_local(load_config(None, base + overrides), 0)]


@pytest.mark.parametrize("overrides", [
    ["precision.compute_dtype=bfloat16"],
    ["precision.master_dtype=bfloat16"],
    ["precision.compute_dtype=bfloat16", "precision.master_dtype=bfloat16", "optim.max_grad_norm=0"],
])
def test_bf16_modes_track_the_fp32_run(overrides, fp32_losses, shm_dir, tmp_path):
    ref = fp32_losses([o for o in overrides if o.startswith("optim.")])
    got = _local_losses(overrides, shm_dir, tmp_path)
    assert got[-1] < got[0]
    np.testing.assert_allclose(got, ref, rtol=1e-2)
    assert got != ref  # it really ran in another precision


def test_offloaded_activations_train_exactly_as_kept_ones(shm_dir, tmp_path):
    """memory.activations offload moves each layer's checkpoint out and back through the backend's
    copy paths (real copies on the CPU backend): the same losses, bit for bit, step after step."""
    from megatrain_ray.orchestration.local import train_local

    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(0).integers(0, 512, size=20_000))
    results = {}
    for offload in ("false", "true"):
        cfg = load_config(None, [
            *SMALL_MODEL,
            "train.seq_len=32", "train.micro_batch_size=2", "train.num_micro_batches=3", "train.steps=3",
            f"data.path={data}", "compute.device=cpu", f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path}",
            f"memory.activations={'offload' if offload == 'true' else 'recompute'}"])
        rows = train_local(cfg, 0)
        results[offload] = [r["loss"] for r in rows]
        moved = sum(n for r in rows for lane, label, _, _, n in r["intervals"] if lane == "d2h" and "inputs" in label)
        # each layer's inputs (micro_batches x [2, 32, 64] fp32) go out once per step when offloaded
        assert moved == (3 * 3 * 2 * 32 * 64 * 4 * 3 if offload == "true" else 0)
    assert results["true"] == results["false"]


def test_gradient_ring_without_clipping_trains_exactly_as_the_whole_gradient_array(shm_dir, tmp_path, monkeypatch):
    """Without clipping and without a stream copy (here fp32 on the CPU; bf16 master on a GPU) the
    store keeps a ring of 3 unit-sized gradient slots instead of a whole-model array: same losses
    bit for bit, and the store shrinks by the array minus the ring."""
    from megatrain_ray.engine.store import host_store as S
    from megatrain_ray.model.precision import Precision
    from megatrain_ray.orchestration.local import train_local

    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(0).integers(0, 512, size=20_000))
    overrides = ["model.hidden_size=64", "model.intermediate_size=176", "model.num_hidden_layers=4",
                 "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=512",
                 "train.seq_len=32", "train.micro_batch_size=2", "train.num_micro_batches=2", "train.steps=3",
                 f"data.path={data}", "compute.device=cpu", f"memory.shm_dir={shm_dir}",
                 f"train.run_dir={tmp_path}", "optim.max_grad_norm=0", "optim.weight_decay=0.1"]
    fp32 = Precision(torch.float32, torch.float32)
    assert S.grad_slots_for(fp32, 0.0) == S.GRAD_RING_SLOTS and S.grad_slots_for(fp32, 1.0) == 0
    assert S.grad_slots_for(Precision(torch.float32, torch.bfloat16), 0.0) == 0  # lives in the stream copy
    ring = [r["loss"] for r in train_local(load_config(None, overrides), 0)]
    monkeypatch.setattr("megatrain_ray.engine.store.host_store.grad_slots_for", lambda precision, max_grad_norm, workers=1, hold_grads=False: 0)
    whole = [r["loss"] for r in train_local(load_config(None, overrides), 0)]  # the whole-model array
    assert ring == whole and len(set(ring)) == 3
    cfg = load_config(None, overrides)
    layout = StoreLayout.build(cfg.model)
    with_ring = S.StoreSpec(cfg.model, fp32, str(shm_dir), 0, "x", grad_slots=S.GRAD_RING_SLOTS)
    without = S.StoreSpec(cfg.model, fp32, str(shm_dir), 0, "x", grad_slots=0)
    assert without.nbytes() - with_ring.nbytes() == 4 * (layout.total - S.GRAD_RING_SLOTS * layout.slot_numel)


def test_compiled_layer_matches_eager_and_falls_back_when_compiling_fails():
    """The compiled decoder layer (inductor, on the CPU here) gives the eager layer's output and
    gradients, and with torch's own partitioner settings the same bits as with its lean ones (which
    recompute, in the backward, elementwise values the forward would have saved); a compiler that
    fails makes it warn once and run eagerly instead of failing the run."""
    from megatrain_ray.engine.compute.compute_worker import CompiledLayer

    cfg = ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64)
    t = LayerTemplate.build(cfg, "layers.0")
    flat = torch.randn(t.numel, generator=torch.Generator().manual_seed(0)) * 0.1
    p = t.bind(flat, fused=True)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    rope = M.rope_cache(cfg, 16, torch.device("cpu"), torch.float32)

    def run(fn):
        y = fn(p, x, rope, cfg)
        return y.detach(), torch.autograd.grad(y.square().sum(), x)[0]

    eager = run(M.decoder_layer)
    torch._dynamo.reset()
    lean = run(CompiledLayer())
    for got, want in zip(lean, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    for got, want in zip(run(CompiledLayer(partitioner=None)), lean):
        assert torch.equal(got, want)
    torch._dynamo.reset()

    def broken_backend(graph, inputs):
        raise RuntimeError("no compiler here")

    warnings = []
    layer = CompiledLayer(backend=broken_backend, warn=warnings.append)
    for _ in range(2):
        for got, want in zip(run(layer), eager):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(warnings) == 1 and "running it eagerly" in warnings[0] and "no compiler here" in warnings[0]


def test_ray_memory_monitor_kill_becomes_one_sentence_naming_the_fix():
    """When Ray's memory monitor kills pipeline work (host RAM past its threshold), the run fails
    with one sentence that says so and names what to change, not Ray's multi-line report."""
    import ray.exceptions

    from megatrain_ray.errors import ActorDied
    from megatrain_ray.orchestration.calls import actor_error as _actor_error

    ray_text = ("Task was killed due to the node running low on memory.\nMemory on the node (IP: 10.0.0.1) "
                "was 119.60GB used / 125.87GB limit (0.950233)")
    for err in (ray.exceptions.OutOfMemoryError(ray_text),
                ray.exceptions.RayTaskError("run", "traceback", ray.exceptions.OutOfMemoryError(ray_text))):
        msg = str(_actor_error(err, "grad-sink"))
        assert msg.startswith("the machine ran out of host memory") and "grad-sink" in msg
        assert "megatrain-ray plan" in msg and "precision.master_dtype=bfloat16" in msg and "\n" not in msg
        assert not isinstance(_actor_error(err, "grad-sink"), ActorDied)  # no restart into the same wall
