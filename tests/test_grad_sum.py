"""The micro-batches' weight gradients summed into fp32 (engine/compute/grad_sum.py): what torch's
``add_`` computes, bit for bit, with the Triton kernel on a GPU; torch's own elsewhere."""

import pytest
import torch

from megatrain_ray.engine.compute.grad_sum import BLOCK, accumulate, add_into


def test_accumulate_adds_each_gradient_into_its_buffer_and_skips_the_missing_ones():
    grads = {"a": torch.ones(3), "b": torch.ones(2, 2), "c": torch.ones(1)}
    accumulate(grads, ["a", "b", "c"], [torch.full((3,), 0.5, dtype=torch.bfloat16), None,
                                        torch.tensor([0.25], dtype=torch.bfloat16)])
    assert grads["a"].tolist() == [1.5] * 3 and grads["b"].tolist() == [[1.0, 1.0]] * 2 and grads["c"].item() == 1.25


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_gpu_kernel_sums_as_add_does_bit_for_bit(dtype):
    gen = torch.Generator("cuda").manual_seed(0)
    for n in (1, BLOCK - 1, BLOCK + 1, 3 * BLOCK + 17, 37888 * 3584):  # the last: a 7B layer's gate_up weight
        acc = torch.randn(n, device="cuda", generator=gen) * torch.logspace(-8, 2, n, device="cuda")
        expected, got = acc.clone(), acc.clone()
        for _ in range(4):  # four micro-batches
            g = (torch.randn(n, device="cuda", generator=gen) * 3).to(dtype)
            expected.add_(g)
            add_into(got, g)
        assert torch.equal(got, expected), n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_strided_view_is_summed_by_add():
    acc = torch.zeros(64, 64, device="cuda")
    g = torch.randn(64, 64, device="cuda").to(torch.bfloat16)
    add_into(acc.t(), g)  # not contiguous: torch's add_ does it
    assert torch.equal(acc.t(), g.float())
