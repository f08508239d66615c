"""precision.grad_dtype: gradients cross to the host in the compute dtype (default) or in fp32.

What the store holds for each choice (bytes per parameter, where the gradient lives), and a run
of the engine in one process with bf16 compute on the CPU: the fp32 choice moves exactly twice the
gradient bytes device-to-host and trains the same first step.
"""

import numpy as np
import pytest
import torch

from megatrain_ray.config import PrecisionSection, load_config
from megatrain_ray.engine.store.host_store import GRAD_RING_SLOTS, StoreSpec, grad_slots_for
from megatrain_ray.errors import ConfigError
from megatrain_ray.model.layout import StoreLayout
from megatrain_ray.model.precision import resolve_precision
from megatrain_ray.orchestration.local import train_local


@pytest.mark.parametrize("grad_dtype,clip,kinds,bytes_per_param", [
    ("auto", 1.0, ("master", "stream", "exp_avg", "exp_avg_sq"), 14),   # the gradient lives in the stream block
    ("float32", 1.0, ("master", "stream", "exp_avg", "exp_avg_sq", "grad"), 18),
    ("float32", 0.0, ("master", "stream", "exp_avg", "exp_avg_sq", "grad"), None),  # a ring of unit slots
])
def test_store_kinds_and_bytes(grad_dtype, clip, kinds, bytes_per_param):
    cfg = load_config(None, ["model.num_hidden_layers=4", f"precision.grad_dtype={grad_dtype}"])
    precision = resolve_precision(cfg.precision, "cuda")
    spec = StoreSpec(cfg.model, precision, "/dev/shm", 0, "t", grad_slots=grad_slots_for(precision, clip))
    layout = StoreLayout.build(cfg.model)
    assert spec.kinds() == kinds
    assert spec.dtype("grad") == (torch.float32 if grad_dtype == "float32" else torch.bfloat16)
    if bytes_per_param is not None:
        assert spec.grad_slots == 0
        assert spec.nbytes() == bytes_per_param * layout.total + 8 * (2 * len(layout.units) + 1)  # versions, hold
    else:
        assert spec.grad_slots == GRAD_RING_SLOTS
        assert spec.numel("grad") == GRAD_RING_SLOTS * layout.slot_numel


def test_grad_dtype_is_validated():
    with pytest.raises(ConfigError, match="precision.grad_dtype must be auto, float32 or bfloat16"):
        PrecisionSection(grad_dtype="fp8").validate()


def test_fp32_gradients_double_the_bytes_out_and_train_the_same_first_step(tmp_path, shm_dir):
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 256, size=20_000))
    rows = {}
    for grad_dtype in ("auto", "float32"):
        cfg = load_config(None, [f"data.path={tmp_path / 'tokens.npy'}", f"memory.shm_dir={shm_dir}",
                                 "compute.device=cpu", "precision.compute_dtype=bfloat16",
                                 f"precision.grad_dtype={grad_dtype}", "train.steps=3", "train.seq_len=32",
                                 "train.micro_batch_size=2", "train.num_micro_batches=2"])
        rows[grad_dtype] = train_local(cfg, 0)
    bf16, fp32 = rows["auto"], rows["float32"]
    assert all(b["d2h_bytes"] > 0 and f["d2h_bytes"] == 2 * b["d2h_bytes"] for b, f in zip(bf16, fp32))
    assert fp32[0]["loss"] == bf16[0]["loss"]  # the same weights and batch: the same forward
    # Later steps start from updates that differ only by the gradient's rounding: close, not equal.
    for b, f in zip(bf16[1:], fp32[1:]):
        assert f["loss"] == pytest.approx(b["loss"], rel=1e-2)
