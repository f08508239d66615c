"""The compact optimizer state (``optim.state: 8bit``): 8-bit AdamW moments and bf16 master weights.

About 4 bytes per parameter instead of 12 (fp32 master + fp32 moments), plus the gradient:

- **Moments**, block-wise dynamically quantized as in 8-bit Adam: the flat state of a unit is cut
  into blocks of :data:`BLOCK` elements, each with its own fp32 scale, the block's absolute
  maximum; an element is stored as an 8-bit floating-point code of its magnitude relative to
  that scale. ``exp_avg`` (signed) as sign + 4 exponent bits + 3 mantissa bits (E4M3);
  ``exp_avg_sq`` in the square-root domain, ``sqrt(exp_avg_sq)`` as 4 exponent + 4 mantissa bits
  (E4M4). The exponent spans 2^-14 .. 1 of the block's scale; smaller values are stored as zero.
  Why these codes: the relative error of an exponent + mantissa code is the same at every
  magnitude (at most 2^-3 of the value for ``exp_avg``, 2^-4 for ``sqrt(exp_avg_sq)``), so small
  entries of a block keep their precision (a linear int8 code would flush everything below
  1/254 of the block's maximum, and a small ``exp_avg_sq`` flushed to zero turns the update into
  ``m / eps``); and the square-root domain quantizes the very quantity the update divides by, so
  the 2^-4 bound is directly a bound on the denominator's error, at the same dynamic range as an
  E5M3 code of ``exp_avg_sq`` itself. Codes are computed with shifts and adds on the float's bits
  (no table, no search), which is what lets the kernel run at memory speed.
- **Rounding** is stochastic everywhere: the master weights (bf16) and both codes. A stored value
  equals the exact one in expectation, so updates far below one bf16 ulp of a weight (lr x 1 on a
  weight of magnitude 1 is below 2^-8 for lr < 4e-3) still move it on average, and an EMA never
  sticks at a code because its step is below half a code step (round-to-nearest would freeze
  ``exp_avg`` at ~80% of its target). Chosen over a bf16 Kahan compensation buffer because that
  buffer costs 2 more bytes per parameter, which is the whole gradient's worth: with stochastic
  rounding, 2 (weights) + 2 (moments) + 2 (bf16 gradient kept for the global-norm clip) = 6 bytes
  per parameter, 4 without clipping (the gradient then waits in a ring of unit slots).
- **Random bits** come from a counter-based hash of (step, unit, element index), not from a
  generator's state: the same on every thread split, and nothing to checkpoint, so a resumed run
  rounds exactly as the uninterrupted one.

The arithmetic of the update is AdamW's (as :mod:`megatrain_ray.engine.adamw_native`), in fp32 on
the decoded state, so the step's own update uses the exact new moments; only what is carried to
the next step is quantized. :func:`step_reference` is the same math in torch operations (the
fallback without a C compiler, and the reference the native kernel is tested against: the two
agree bit for bit, since both use only correctly rounded fp32 operations in the same order).
The master weights are also the copy streamed to the GPU (bf16 compute): no separate stream copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 2048
"""Elements per quantization block (one fp32 scale each: 0.002 bytes per parameter per moment).
Divides the layout's unit alignment, so every unit starts on a block boundary."""
M_BITS = 3
"""Mantissa bits of the ``exp_avg`` code (1 sign + 4 exponent + 3 mantissa)."""
S_BITS = 4
"""Mantissa bits of the ``sqrt(exp_avg_sq)`` code (4 exponent + 4 mantissa)."""
MIN_EXP = -14
"""Smallest exponent of a code, relative to the block's scale; below 2^MIN_EXP a value is stored as zero."""
_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def mix32(x: torch.Tensor) -> torch.Tensor:
    """x: int64 tensor of 32-bit values -> a bijective 32-bit hash of each (Wellons' lowbias32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def rng_key(step: int, unit: int) -> int:
    """The 32-bit key of one unit's random bits at AdamW step ``step`` (1-based)."""
    h = int(mix32(torch.tensor([(unit * _GOLDEN + 1) & _MASK32]))[0])
    return int(mix32(torch.tensor([(step * 0x85EBCA6B + h) & _MASK32]))[0])


def random_bits(index: torch.Tensor, key: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """index: [n] int64 element indices in the unit -> three [n] int64 32-bit random words: for the
    weight's rounding, the ``exp_avg`` code's and the ``sqrt(exp_avg_sq)`` code's."""
    h1 = mix32((index & _MASK32) ^ key)
    h2 = mix32((h1 + _GOLDEN) & _MASK32)
    h3 = mix32((h2 + _GOLDEN) & _MASK32)
    return h1, h2, h3


def _bits(x: torch.Tensor) -> torch.Tensor:
    """x: fp32 -> its bit pattern as int64 in [0, 2^32)."""
    return x.contiguous().view(torch.int32).to(torch.int64) & _MASK32


def _float(bits: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns in [0, 2^32) -> fp32."""
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def encode(r: torch.Tensor, rnd: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """r: [n] fp32 magnitudes relative to the block scale (in [0, 1]); rnd: [n] int64 random words
    -> [n] int64 codes (exponent above ``mantissa_bits`` mantissa bits; 0 is zero), rounded stochastically."""
    drop = 23 - mantissa_bits
    u = _bits(r) + (rnd & ((1 << drop) - 1))
    e = (u >> 23) - (127 + MIN_EXP - 1)
    mant = (u >> drop) & ((1 << mantissa_bits) - 1)
    code = torch.where(e > 15, torch.full_like(e, 15 << mantissa_bits), (e << mantissa_bits) | mant)
    return torch.where(e <= 0, torch.zeros_like(e), code)


def decode(code: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """[n] integer codes (without sign) -> [n] fp32 magnitudes relative to the block scale."""
    code = code.to(torch.int64)
    e = (code >> mantissa_bits) & 15
    mant = code & ((1 << mantissa_bits) - 1)
    value = _float(((e + (127 + MIN_EXP - 1)) << 23) | (mant << (23 - mantissa_bits)))
    return torch.where(e == 0, torch.zeros_like(value), value)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """x: [n] -> [ceil(n / BLOCK), BLOCK], the last block padded with zeros."""
    nb = -(-x.numel() // BLOCK)
    out = x.new_zeros(nb * BLOCK)
    out[:x.numel()] = x
    return out.view(nb, BLOCK)


def absmax(x: torch.Tensor) -> torch.Tensor:
    """x: [n] fp32 -> [ceil(n / BLOCK)] fp32 absolute maximum of each block."""
    return _blocks(x.abs()).amax(dim=1)


def quantize(x: torch.Tensor, rnd: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [n] fp32, rnd: [n] int64 -> (codes [n] uint8, scales [ceil(n / BLOCK)] fp32).

    ``signed``: the E4M3 code with a sign bit (``exp_avg``); else E4M4 of a value >= 0 (``sqrt(exp_avg_sq)``).
    """
    scales = absmax(x)
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    r = (_blocks(x.abs()) * inv[:, None]).reshape(-1)[:x.numel()]
    code = encode(r, rnd, M_BITS if signed else S_BITS)
    if signed:
        code = code | torch.where(x < 0, 0x80, 0)
    return code.to(torch.uint8), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    """codes: [n] uint8, scales: [ceil(n / BLOCK)] fp32 -> [n] fp32 (the inverse of :func:`quantize`)."""
    c = codes.to(torch.int64)
    mag = decode(c & 0x7F if signed else c, M_BITS if signed else S_BITS)
    value = (_blocks(mag) * scales[:, None]).reshape(-1)[:codes.numel()]
    return torch.where(c >= 0x80, -value, value) if signed else value


def round_bf16(x: torch.Tensor, rnd: torch.Tensor) -> torch.Tensor:
    """x: [n] fp32, rnd: [n] int64 -> [n] bf16, rounded stochastically (E[result] = x) with 16 random bits."""
    u = (_bits(x) + (rnd & 0xFFFF)) & _MASK32
    return (u >> 16).to(torch.int32).to(torch.int16).view(torch.bfloat16)


@dataclass(frozen=True)
class StepConstants:
    """The fp32 scalars of one unit's step, rounded once here so the kernel and the reference agree."""

    decay_a: float
    """1 - lr * weight decay of the matrices."""
    decay_b: float
    """1 - lr * weight decay of the norms and biases."""
    w1: float
    """1 - beta1."""
    b2: float
    one_minus_b2: float
    step_size: float
    """lr / (1 - beta1^step)."""
    bc2_sqrt: float
    """sqrt(1 - beta2^step)."""
    eps: float
    scale: float
    """The gradient's factor (global-norm clipping)."""

    @classmethod
    def of(cls, step: int, lr: float, beta1: float, beta2: float, eps: float, wd_a: float, wd_b: float,
           scale: float) -> "StepConstants":
        f = np.float32
        lr32 = f(lr)
        return cls(float(f(1) - lr32 * f(wd_a)), float(f(1) - lr32 * f(wd_b)), float(f(1) - f(beta1)), float(f(beta2)),
                   float(f(1) - f(beta2)), float(lr32 / f(1.0 - beta1 ** step)), float(f((1.0 - beta2 ** step) ** 0.5)),
                   float(f(eps)), float(f(scale)))


def step_reference(master: torch.Tensor, grad: torch.Tensor, qm: torch.Tensor, qv: torch.Tensor,
                   sm: torch.Tensor, sv: torch.Tensor, decay_numel: int, c: StepConstants, key: int,
                   index0: int = 0) -> None:
    """One compact AdamW step on one unit, in place, with torch operations (see the module docstring), on
    whichever device the tensors share (the scalars are 0-dim CPU tensors, which torch takes as scalars, but
    the divisor, which lives on that device).

    master: [n] bf16; grad: [n] bf16 or fp32; qm, qv: [n] uint8 codes of exp_avg and sqrt(exp_avg_sq);
    sm, sv: [ceil(n / BLOCK)] fp32 block scales; the first ``decay_numel`` elements decay with
    ``c.decay_a``, the rest with ``c.decay_b``; ``key``: :func:`rng_key` of the step and unit; ``index0``:
    the index in the unit of the first element (a piece of a unit starts on a block boundary).
    """
    n = master.numel()
    f32 = torch.float32
    g = grad.to(f32) * torch.tensor(c.scale, dtype=f32)
    m0 = dequantize(qm, sm, signed=True)
    s0 = dequantize(qv, sv, signed=False)
    v0 = s0 * s0
    decay = torch.full((n,), c.decay_b, dtype=f32, device=master.device)
    decay[:max(0, decay_numel)] = c.decay_a
    param = master.to(f32) * decay
    m1 = m0 + torch.tensor(c.w1, dtype=f32) * (g - m0)
    v1 = v0 * torch.tensor(c.b2, dtype=f32) + g * g * torch.tensor(c.one_minus_b2, dtype=f32)
    # Correctly rounded, as C's sqrtf: torch's fp32 sqrt is 1 ulp off on some CPUs (an AMD EPYC, AVX512);
    # a float64 root rounded to fp32 is the correctly rounded fp32 root (53 >= 2 * 24 + 2 bits).
    s1 = torch.sqrt(v1.double()).float()
    # the divisor on the tensors' device: torch's CUDA division by a CPU scalar multiplies by its
    # reciprocal (two roundings), which the native kernel's division does not
    denom = s1 / torch.tensor(c.bc2_sqrt, dtype=f32, device=master.device) + torch.tensor(c.eps, dtype=f32)
    param = param - torch.tensor(c.step_size, dtype=f32) * m1 / denom
    h1, h2, h3 = random_bits(torch.arange(index0, index0 + n, dtype=torch.int64, device=master.device), key)
    master.copy_(round_bf16(param, h1))
    codes, scales = quantize(m1, h2, signed=True)
    qm.copy_(codes)
    sm.copy_(scales)
    codes, scales = quantize(s1, h3, signed=False)
    qv.copy_(codes)
    sv.copy_(scales)


def num_blocks(numel: int) -> int:
    return -(-numel // BLOCK)
