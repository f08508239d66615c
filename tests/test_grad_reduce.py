"""The host-side gradient sum of experimental.grad_reduce=host, against float64, and its settings.

``sum_copies`` adds N workers' host copies of a unit's gradient in fp32 and rounds once into the
first copy. Bounds: the two fp32 additions are off by at most 2 x 2^-24 of the addends'
magnitudes, and the one rounding to bf16 by half a bf16 ulp (2^-8 relative) of the result; the
squared norm is an fp32 dot product per piece (1M positive terms, blocked summation: ~sqrt(n) x
2^-24 ~ 6e-5 relative at worst in practice), so 1e-4 relative, where a lost or doubled copy moves
it by tens of percent.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatrain_ray.config import load_config
from megatrain_ray.engine.grad_reduce import SUM_CHUNK, sum_copies
from megatrain_ray.engine.store.host_store import HostStore, StoreSpec, peer_grads_for
from megatrain_ray.errors import ConfigError
from megatrain_ray.model.precision import resolve_precision


def _copies(dtype, n=3, numel=2 * SUM_CHUNK + 12345):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(numel, generator=g) * (k + 1)).to(dtype) for k in range(n)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sum_copies_against_float64(dtype):
    copies = _copies(dtype)
    exact = sum(c.double() for c in copies)
    without_one = float((copies[0].double() + copies[2].double()).pow(2).sum())
    with ThreadPoolExecutor(3) as pool:
        sq_norm = sum_copies(copies, pool, 3)
    rounding = 2.0 ** -8 if dtype == torch.bfloat16 else 0.0  # the one rounding into the copy's dtype
    magnitude = exact.abs() + 2 * sum(c.double().abs() for c in copies[1:])  # >= the addends' |a| + |b| + |c|
    assert torch.all((copies[0].double() - exact).abs() <= rounding * exact.abs() + 2.0 ** -23 * magnitude)
    assert sq_norm == pytest.approx(float(exact.pow(2).sum()), rel=1e-4)
    assert sq_norm != pytest.approx(without_one, rel=0.1)  # a lost copy would show


def test_sum_copies_is_the_same_on_any_number_of_threads():
    one, many = _copies(torch.bfloat16), _copies(torch.bfloat16)
    n1 = sum_copies(one)
    with ThreadPoolExecutor(4) as pool:
        n4 = sum_copies(many, pool, 4)
    assert n1 == n4 and torch.equal(one[0], many[0])


def test_peer_grad_copies_in_the_store(shm_dir):
    cfg = load_config(None, ["model.num_hidden_layers=2", "compute.device=cpu", f"memory.shm_dir={shm_dir}"])
    precision = resolve_precision(cfg.precision, "cpu")
    assert peer_grads_for("allreduce", 4) == 0 and peer_grads_for("host", 4) == 3
    spec = StoreSpec(cfg.model, precision, shm_dir, 1, "peers", peer_grads=peer_grads_for("host", 3))
    plain = StoreSpec(cfg.model, precision, shm_dir, 1, "plain")
    assert "peer_grad" in spec.kinds() and "peer_grad" not in plain.kinds()
    assert spec.nbytes() - plain.nbytes() == 2 * plain.numel("grad") * precision.grad.itemsize
    store = HostStore(spec, create=True)
    try:
        blocks = [store.grad_block(1, -1, k) for k in range(3)]
        for k, b in enumerate(blocks):
            b.fill_(k + 1)
        assert [float(b[0]) for b in blocks] == [1.0, 2.0, 3.0]  # three distinct places
        assert blocks[0].data_ptr() == store.block("grad", 1).data_ptr()
        with pytest.raises(ValueError, match="gradient copy 3 is not one of the store's 2 peer copies"):
            store.grad_block(1, -1, 3)
    finally:
        from megatrain_ray.engine.store import shm

        shm.remove_run(shm_dir, 1, "peers")


def test_grad_reduce_settings_are_checked():
    with pytest.raises(ConfigError, match="experimental.grad_reduce must be allreduce or host, got 'nccl'"):
        load_config(None, ["experimental.grad_reduce=nccl"])
    with pytest.raises(ConfigError, match=r"experimental.grad_reduce host needs parallel.nodes=1 \(got 2\)"):
        load_config(None, ["experimental.grad_reduce=host", "parallel.nodes=2", "train.num_micro_batches=2"])
