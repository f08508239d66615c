"""The compact AdamW step (``optim.state: 8bit``) on a GPU as one fused kernel, written in Triton.

:func:`~megatrain_ray.engine.compact.step_reference` runs the step as some sixty torch operations on
int64 and fp32 temporaries: on an H200 each element crosses the GPU's memory hundreds of times. The
kernel here reads the master weight, the gradient and the two codes once and writes them once (the
block scales besides), one program per quantization block (:data:`~megatrain_ray.engine.compact.BLOCK`
elements, whose absolute maxima it reduces itself), with the arithmetic of the sink's native kernel
(:mod:`megatrain_ray.engine.adamw_native`): the same correctly rounded fp32 operations in the same
order (no fused multiply-add: ``enable_fp_fusion=False``; IEEE division and square root), the same
counter-based random words, so the same bits as ``step_reference`` (tests/test_gpu_device_updates.py
holds it to that on a GPU).

:func:`step` takes the tensors of one piece on a CUDA device where Triton is installed
(:func:`available`); elsewhere the caller runs ``step_reference``.
"""

from __future__ import annotations

import torch

from . import compact


try:
    import triton
    import triton.language as tl
except ImportError:  # then the caller runs step_reference
    triton = None

if triton is not None:
    @triton.jit
    def _mix32(x):  # Wellons' lowbias32 on uint32 (wrapping), as compact.mix32
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _magnitude(code, MB: tl.constexpr):  # a code without its sign -> its value over the block scale
        e = (code >> MB) & 15
        bits = ((e + 112) << 23) | ((code & ((1 << MB) - 1)) << (23 - MB))
        return tl.where(e == 0, 0.0, bits.to(tl.float32, bitcast=True))

    @triton.jit
    def _encode(r, rnd, MB: tl.constexpr):  # r in [0, 1] -> its code, rounded stochastically with rnd
        u = r.to(tl.uint32, bitcast=True) + (rnd & ((1 << (23 - MB)) - 1))
        e = (u >> 23).to(tl.int32) - 112
        code = tl.where(e > 15, 15 << MB, (e << MB) | ((u >> (23 - MB)) & ((1 << MB) - 1)).to(tl.int32))
        return tl.where(e <= 0, 0, code)

    @triton.jit
    def _compact_step(p, p_bits, g, qm, qv, sm, sv, n, decay_end, decay_a, decay_b, w1, b2, omb2, step_size,
                      bc2_sqrt, eps, scale, key, idx0, BLOCK: tl.constexpr):
        block = tl.program_id(0)
        i = block * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        grad = tl.load(g + i, mask=inside, other=0.0).to(tl.float32) * scale
        cm = tl.load(qm + i, mask=inside, other=0).to(tl.uint32)
        m0 = _magnitude(cm & 0x7F, 3) * tl.load(sm + block)
        m0 = tl.where((cm & 0x80) != 0, -m0, m0)
        s0 = _magnitude(tl.load(qv + i, mask=inside, other=0).to(tl.uint32), 4) * tl.load(sv + block)
        v0 = s0 * s0
        param = tl.load(p + i, mask=inside, other=0.0).to(tl.float32) * tl.where(i < decay_end, decay_a, decay_b)
        m1 = m0 + w1 * (grad - m0)
        v1 = v0 * b2 + grad * grad * omb2
        s1 = tl.sqrt_rn(v1)
        param = param - tl.div_rn(step_size * m1, tl.div_rn(s1, bc2_sqrt) + eps)
        h1 = _mix32((idx0 + i).to(tl.uint32) ^ key.to(tl.uint32))
        rounded = (param.to(tl.uint32, bitcast=True) + (h1 & 0xFFFF)) >> 16
        tl.store(p_bits + i, rounded.to(tl.uint16).to(tl.int16, bitcast=True), mask=inside)
        # the block's scales: the absolute maxima (as the bits' maxima: the same order for values >= 0)
        m_max = tl.max(tl.where(inside, m1.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0), axis=0)
        s_max = tl.max(tl.where(inside, s1.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0), axis=0)
        m_scale = m_max.to(tl.float32, bitcast=True)
        s_scale = s_max.to(tl.float32, bitcast=True)
        tl.store(sm + block, m_scale)
        tl.store(sv + block, s_scale)
        m_inv = tl.where(m_scale > 0, tl.div_rn(1.0, m_scale), 0.0)
        s_inv = tl.where(s_scale > 0, tl.div_rn(1.0, s_scale), 0.0)
        h2 = _mix32(h1 + 0x9E3779B9)
        h3 = _mix32(h2 + 0x9E3779B9)
        code = _encode(tl.abs(m1) * m_inv, h2, 3) | tl.where(m1 < 0, 0x80, 0)
        tl.store(qm + i, code.to(tl.uint8), mask=inside)
        tl.store(qv + i, _encode(s1 * s_inv, h3, 4).to(tl.uint8), mask=inside)


def available(device: torch.device) -> bool:
    """Whether :func:`step` runs on ``device``: a CUDA device, with Triton installed."""
    return device.type == "cuda" and triton is not None


def step(master: torch.Tensor, grad: torch.Tensor, qm: torch.Tensor, qv: torch.Tensor, sm: torch.Tensor,
         sv: torch.Tensor, decay_numel: int, c: compact.StepConstants, key: int, index0: int = 0) -> None:
    """:func:`~megatrain_ray.engine.compact.step_reference` (the same arguments: master [n] bf16, grad [n]
    bf16 or fp32, qm, qv [n] uint8, sm, sv [ceil(n / BLOCK)] fp32, all contiguous on one CUDA device;
    ``index0`` a block boundary) as one kernel launch on the current stream, in place."""
    n = master.numel()
    if n == 0:
        return
    _compact_step[(compact.num_blocks(n),)](
        master, master.view(torch.int16), grad, qm, qv, sm, sv, n, decay_numel, c.decay_a, c.decay_b, c.w1, c.b2,
        c.one_minus_b2, c.step_size, c.bc2_sqrt, c.eps, c.scale, key, index0, BLOCK=compact.BLOCK,
        num_warps=8, enable_fp_fusion=False)
