"""gpt-oss's attention with sinks on a GPU (skipped without CUDA): FlexAttention's path against the
reference that writes the scores out.

:func:`~megatrain_ray.model.sink_attention.flex_sink_attention` (the path a CUDA run takes, with the
engine's BlockMask of :func:`~megatrain_ray.engine.compute.sequence.attention_mask`: causal, a sliding window,
packed documents) and :func:`~megatrain_ray.model.sink_attention.sink_attention` (the CPU path, a dense
mask of the same rule) in fp32 on the GPU: the outputs and the gradients of q, k, v and the sinks
agree within fp32 rounding of a softmax over S keys (atol 1e-4 relative to values of order 1), eager
and compiled. A wrong log-sum-exp (base 2 instead of e, or no gradient through it) moves the sinks'
gradient by far more than that, and the sinks' gradient is checked non-zero.
"""

import pytest
import torch

from megatrain_ray.engine.compute.sequence import attention_mask
from megatrain_ray.model.sink_attention import flex_sink_attention, sink_attention, window_mask

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _inputs(b=2, h=8, kv=2, s=256, d=64):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, device="cuda", generator=g) for n in (h, kv, kv))
    sinks = torch.randn(h, device="cuda", generator=g)
    return [t.requires_grad_(True) for t in (q, k, v, sinks)]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("window,packed", [(None, False), (32, False), (32, True)])
def test_flex_sink_attention_matches_the_written_out_scores(window, packed, compiled):
    q, k, v, sinks = _inputs()
    b, s = q.shape[0], q.shape[2]
    positions = torch.arange(s, device="cuda").repeat(b, 1)
    if packed:  # two documents in each sequence, starting at 0 and at 100
        positions[:, 100:] -= 100
    block_mask = attention_mask(positions, window)
    dense = window_mask(s, window, q.device, positions)
    flex = torch.compile(flex_sink_attention) if compiled else flex_sink_attention
    grad_out = torch.randn_like(q)
    outs, grads = [], []
    for fn, mask in ((flex, block_mask), (sink_attention, dense)):
        out = fn(q, k, v, sinks, mask)
        outs.append(out.detach())
        grads.append(torch.autograd.grad(out, (q, k, v, sinks), grad_out))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-4)
    for name, ours, ref in zip("q k v sinks".split(), *grads):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"d{name}: {m}")
    assert grads[1][3].abs().min() > 0  # every head's sink takes a gradient
