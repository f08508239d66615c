"""optim.placement device on a GPU (skipped without CUDA): the streamed units' AdamW through
``torch._fused_adamw_`` on the device, their state copied in from the host store and written back,
against the host's update of the same fp32 gradient (megatrain_ray.engine.compute.device_updates).

The two are the same arithmetic in different kernels (the host's native C kernel or torch's CPU
kernel; the GPU's fused kernel), so they differ only in rounding: each element's update is a few
fp32 operations (the moments' two multiply-adds, the bias corrections, a square root, a division),
so a moment differs by a few units in the last place (rtol 2**-20, ~8 ulps) and the master weights by
one rounding of their own plus a few ulps of the step, which is at most ~lr in size (atol lr * 2**-18
per step, over 3 steps). The stream copy is the master's own rounding to bf16, written beside it.
"""

import os

import pytest
import torch

from megatrain_ray.config import load_config
from megatrain_ray.engine.compute.device import CudaBackend
from megatrain_ray.engine.compute.device_updates import StreamedUpdates
from megatrain_ray.engine.optim import AdamWRunner
from megatrain_ray.engine.sink.updates import ExactAdamW
from megatrain_ray.engine.store.host_store import ParameterStore, StoreSpec
from megatrain_ray.model.precision import Precision
from megatrain_ray.orchestration.local import train_local

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
        gen = torch.Generator().manual_seed(0)
        for step in range(STEPS):
            grads = {u: torch.randn(host.store.layout.templates[u].numel, generator=gen) for u in units}
            sq = [torch.dot(g, g) for g in grads.values()]
            coef = min(1.0, cfg.optim.max_grad_norm / (sum(float(s) for s in sq) ** 0.5 + 1e-6))
            for u in units:
                exact.update(u, grads[u].clone(), coef, step)
                updates.take_grad(u, grads[u].cuda())
            updates.end_step(step, [s.cuda() for s in sq], sync=False, for_checkpoint=False)
            for u in units:
                assert dev.store.version(u) == step + 1
        lr = cfg.optim.lr
        for u in units:
            for kind in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(dev.store.block(kind, u), host.store.block(kind, u), rtol=2**-20, atol=1e-30)
            torch.testing.assert_close(dev.store.block("master", u), host.store.block("master", u), rtol=2**-23,
                                       atol=STEPS * lr * 2**-18)
            assert torch.equal(dev.store.block("stream", u), dev.store.block("master", u).to(torch.bfloat16))
        updates.close()
    finally:
        runner.close()
        backend.close()
        host.close()
        dev.close()


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
    assert all(r["device_update_busy_s"] > 0 and r["update_busy_s"] == 0 for r in dev)
