"""optim.placement device on a GPU (skipped without CUDA): the streamed units' AdamW through
``torch._fused_adamw_`` on the device, their state copied in from the host store and written back,
against the host's update of the same fp32 gradient (megatrain_ray.engine.compute.device_updates).

The two are the same arithmetic in different kernels (the host's native C kernel; the GPU's fused
kernel), so they differ only in rounding; but not by a few ulps of each moment: a first moment
summed from gradients of both signs cancels to near zero while its rounding stays that of its terms
(on the H200 the two kernels' first moments differed by up to 0.09% of themselves on 2% of the
elements, 5.5e-11 absolute). So each is held to the float64 truth of the same steps, within the
bound fp32 rounding of each term allows (tests/adamw_truth.py derives it); the stream copy is the
master's own rounding to bf16, written beside it.
"""

import os

import pytest
import torch

from megatrain_ray.config import load_config
from megatrain_ray.engine import compact, compact_fused
from megatrain_ray.engine.compute.device import CudaBackend
from megatrain_ray.engine.compute.device_updates import StreamedUpdates
from megatrain_ray.engine.optim import AdamWRunner, decay_ranges
from megatrain_ray.engine.sink.updates import CompactAdamW, ExactAdamW
from megatrain_ray.engine.store.host_store import SCALE_KINDS, ParameterStore, StoreSpec
from megatrain_ray.model.precision import Precision, resolve_precision
from megatrain_ray.orchestration.local import train_local

from adamw_truth import AdamWTruth

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 3


def test_the_gpu_update_of_a_streamed_unit_matches_the_host_update_within_rounding(shm_dir, monkeypatch):
    from megatrain_ray.engine.compute import device_updates
    monkeypatch.setattr(device_updates, "PIECE", 5000)  # several pieces per unit, across the decay spans
    cfg = load_config(None, [f"memory.shm_dir={shm_dir}", "optim.weight_decay=0.1", "optim.warmup_steps=1",
                             "model.hidden_size=128", "model.intermediate_size=352"])
    spec = lambda run: StoreSpec(cfg.model, Precision(torch.float32, torch.bfloat16), shm_dir,  # noqa: E731
                                 os.getpid(), run)
    host, dev = ParameterStore(spec("host"), seed=0), ParameterStore(spec("dev"), seed=0)
    runner, backend = AdamWRunner(2), CudaBackend(1, 1, torch.bfloat16)
    try:
        units = tuple(range(len(host.store.layout.units)))
        exact = ExactAdamW(host.store, runner, cfg.optim, 10)
        updates = StreamedUpdates(dev.store, backend, units, cfg.optim, 10, timeout_s=60)
        o, templates = cfg.optim, host.store.layout.templates
        truth = {u: AdamWTruth(host.store.block("master", u), decay_ranges(templates[u].numel,
                               templates[u].decay_numel, o), o.beta1, o.beta2, o.eps) for u in units}
        gen = torch.Generator().manual_seed(0)
        for step in range(STEPS):
            grads = {u: torch.randn(templates[u].numel, generator=gen) for u in units}
            sq = [torch.dot(g, g) for g in grads.values()]
            coef = min(1.0, o.max_grad_norm / (sum(float(s) for s in sq) ** 0.5 + 1e-6))
            assert coef < 1.0  # clipped: the factor matters
            for u in units:
                exact.update(u, grads[u].clone(), coef, step)
                updates.take_grad(u, grads[u].cuda())
                truth[u].step(grads[u], coef, exact.lr(step))
            updates.end_step(step, [s.cuda() for s in sq], sync=False, for_checkpoint=False)
            updates.join()  # the updater thread's work done
            for u in units:
                assert dev.store.version(u) == step + 1
        for u in units:
            for name, store in (("device", dev), ("host", host)):
                truth[u].assert_close(*(store.store.block(k, u) for k in ("master", "exp_avg", "exp_avg_sq")),
                                      f"{name} update, unit {u}:")
            assert torch.equal(dev.store.block("stream", u), dev.store.block("master", u).to(torch.bfloat16))
        updates.close()
    finally:
        runner.close()
        backend.close()
        host.close()
        dev.close()


@pytest.mark.parametrize("fused", [True, False])
def test_the_gpu_update_of_the_compact_state_is_the_sink_update_bit_for_bit(fused, shm_dir, monkeypatch):
    """The 8-bit state on the GPU, by the fused kernel (:mod:`~megatrain_ray.engine.compact_fused`) or by
    :func:`~megatrain_ray.engine.compact.step_reference` in torch's CUDA kernels (correctly rounded fp32
    operations one at a time, the root in float64, integer hashing and bit codes), against the sink's
    native kernel on the same gradients: every array equal, over pieces and chunks smaller than a unit."""
    from megatrain_ray.engine.compute import device_updates
    if fused and not compact_fused.available(torch.device("cuda")):
        pytest.skip("no Triton: the device update runs step_reference")
    monkeypatch.setattr(device_updates.compact_fused, "available", lambda device: fused)
    monkeypatch.setattr(device_updates, "PIECE", 1 << 14)
    monkeypatch.setattr(device_updates, "COMPACT_CHUNK", 1 << 12)
    cfg = load_config(None, [f"memory.shm_dir={shm_dir}", "optim.weight_decay=0.1", "optim.warmup_steps=1",
                             "optim.state=8bit", "model.hidden_size=128", "model.intermediate_size=352"])
    precision = resolve_precision(cfg.precision, "cuda", "8bit")
    stores = [ParameterStore(StoreSpec(cfg.model, precision, shm_dir, os.getpid(), run), seed=0) for run in ("h", "d")]
    host, dev = (p.store for p in stores)
    runner, backend = AdamWRunner(2), CudaBackend(1, 1, torch.bfloat16)
    try:
        units = tuple(range(len(host.layout.units)))
        sink = CompactAdamW(host, runner, cfg.optim, 10)
        updates = StreamedUpdates(dev, backend, units, cfg.optim, 10, timeout_s=60)
        assert updates.fused == fused
        gen = torch.Generator().manual_seed(0)
        for step in range(STEPS):
            grads = {u: torch.randn(host.layout.templates[u].numel, generator=gen) for u in units}
            sq = [torch.dot(g, g) for g in grads.values()]
            coef = min(1.0, cfg.optim.max_grad_norm / (sum(float(s) for s in sq) ** 0.5 + 1e-6))
            for u in units:
                sink.update(u, grads[u].clone(), coef, step)
                updates.take_grad(u, grads[u].cuda())
            updates.end_step(step, [s.cuda() for s in sq], sync=False, for_checkpoint=False)
            updates.join()  # the updater thread's work done
        for u in units:
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(dev.block(kind, u), host.block(kind, u)), (u, kind)
            for kind in SCALE_KINDS:
                assert torch.equal(dev.scale_block(kind, u), host.scale_block(kind, u)), (u, kind)
        updates.close()
    finally:
        runner.close()
        backend.close()
        for p in stores:
            p.close()


def test_a_run_with_its_updates_on_the_gpu_follows_the_host_run(shm_dir, tmp_path):
    """With fp32 gradients on the host too, the two runs differ only by the kernels' rounding: their
    losses over a few steps agree to 1e-3 (bf16 compute rounds the weights they stream)."""
    def run(placement):
        return train_local(load_config(None, [
            f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path}", "compute.device=cuda", "train.steps=4",
            "train.seq_len=64", "train.micro_batch_size=2", "precision.grad_dtype=float32", "memory.resident=none",
            "optim.weight_decay=0.1", f"optim.placement={placement}"]), 1)
    host, dev = run("host"), run("device")
    assert [r["loss"] for r in dev] == pytest.approx([r["loss"] for r in host], rel=1e-3)
    assert all(r["update_busy_s"] == 0 for r in dev) and sum(r["device_update_busy_s"] for r in dev) > 0


@pytest.mark.skipif(not compact_fused.available(torch.device("cuda")) if torch.cuda.is_available() else True,
                    reason="needs Triton")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_the_fused_compact_kernel_is_step_reference_bit_for_bit(grad_dtype):
    """One kernel against the torch form over steps whose state it carries: a piece that ends inside a
    block, its decay span ending inside another, an offset into its unit (the random words), gradients
    of very different sizes (the codes' range: zeros, subnormal ratios, the clamp) and a block of
    zero gradient (a zero scale)."""
    n, decay, index0 = 5 * compact.BLOCK + 777, 2 * compact.BLOCK + 100, 3 * compact.BLOCK
    gen = torch.Generator().manual_seed(1)
    state = {"master": (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16),
             "qm": torch.zeros(n, dtype=torch.uint8), "qv": torch.zeros(n, dtype=torch.uint8),
             "sm": torch.zeros(compact.num_blocks(n)), "sv": torch.zeros(compact.num_blocks(n))}
    ours = {k: v.cuda() for k, v in state.items()}
    theirs = {k: v.cuda() for k, v in state.items()}
    for step in range(1, 5):
        grad = torch.randn(n, generator=gen) * torch.logspace(-12, 2, n)[torch.randperm(n, generator=gen)]
        grad[compact.BLOCK:2 * compact.BLOCK] = 0
        grad = grad.to(grad_dtype).cuda()
        c = compact.StepConstants.of(step, 1e-3, 0.9, 0.999, 1e-8, 0.1, 0.0, 0.7)
        key = compact.rng_key(step, 3)
        compact_fused.step(ours["master"], grad, ours["qm"], ours["qv"], ours["sm"], ours["sv"], decay, c, key, index0)
        compact.step_reference(theirs["master"], grad, theirs["qm"], theirs["qv"], theirs["sm"], theirs["sv"], decay, c,
                               key, index0)
        for k in state:
            a, b = ours[k], theirs[k]
            assert torch.equal(a.view(torch.int16) if k == "master" else a,
                               b.view(torch.int16) if k == "master" else b), (step, k)
    assert int((theirs["qm"] != 0).sum()) > n // 2 and float(theirs["sm"][1]) == 0.0
