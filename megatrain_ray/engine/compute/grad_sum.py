"""Each micro-batch's weight gradients added into the layer's fp32 gradient buffer.

Autograd gives a weight's gradient of one micro-batch in the weights' dtype (bf16); the step's sum
over its micro-batches is kept in fp32, in views of the layer's flat gradient buffer. torch's
``add_`` of a bf16 tensor into an fp32 one runs its mixed-dtype kernel, which loads one element at a
time: on an H100, ~57% of the memory's bandwidth, and 136 ms (2.4%) of a 7B step. On a CUDA device
where Triton is installed, :func:`add_into` runs one kernel that loads both in wide vectors. It computes what
``add_`` does, element by element: the gradient upcast to fp32 (exact) and one rounded fp32 add, so
the same bits (tests/test_grad_sum.py holds it to that on a GPU).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # then add_ does it
    triton = None

BLOCK = 4096
"""Elements per program of the kernel."""

if triton is not None:
    @triton.jit
    def _add_into(acc, grad, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        total = tl.load(acc + i, mask=inside) + tl.load(grad + i, mask=inside).to(tl.float32)
        tl.store(acc + i, total, mask=inside)


def add_into(acc: torch.Tensor, grad: torch.Tensor) -> None:
    """acc [any shape] fp32 += grad [the same shape] (bf16, fp16 or fp32), in place."""
    if (triton is None or not acc.is_cuda or acc.dtype != torch.float32 or grad.device != acc.device
            or grad.shape != acc.shape or not (acc.is_contiguous() and grad.is_contiguous())):
        acc.add_(grad)
        return
    n = acc.numel()
    if n:
        _add_into[(triton.cdiv(n, BLOCK),)](acc, grad, n, BLOCK=BLOCK, num_warps=8)


def accumulate(grads: dict[str, torch.Tensor], names, gws) -> None:
    """Add each weight's gradient ``gws[i]`` (None: it got none) into ``grads[names[i]]``."""
    for name, gw in zip(names, gws):
        if gw is not None:
            add_into(grads[name], gw)
