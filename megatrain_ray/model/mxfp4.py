"""MXFP4 (OCP Microscaling FP4) arithmetic, in the layout of gpt-oss's Hub checkpoints, as torch ops on any device.

A LoRA run's frozen base may store its routed experts' weights as MXFP4 (lora.base_format ``mxfp4``,
:mod:`megatrain_ray.model.quant_layout`). A weight [out, in] is cut along each row into blocks of
:data:`MX_BLOCK` consecutive elements (``in`` must be a multiple of it); each block keeps

- 32 fp4 e2m1 codes (sign bit 3, two exponent bits, one mantissa bit: the values :data:`FP4_VALUES`),
  two per byte, the *low* nibble first (element 2j in the low nibble of byte j, 2j + 1 in the high);
- one uint8 e8m0 scale s: the block's values are fp4(code) * 2^(s - 127).

The bytes of a weight are its codes [out * in / 2] then its scales [out * in / 32], each row-major:
per row, exactly the Hub's ``*_blocks`` [.., rows, in/32, 16] and ``*_scales`` [.., rows, in/32]
flattened, so a gpt-oss checkpoint's experts are read into a store as they are. 4.25 bits a weight.

Quantizing (:func:`quantize_mxfp4`) follows the OCP MX v1.0 spec's conversion (section 6.3): the
block's shared exponent is floor(log2(absmax)) - 2 (2: the largest exponent of e2m1, whose largest
value is 6 = 1.5 x 2^2), taken from the absmax's fp32 exponent bits and clamped to e8m0's finite
range [-127, 127]; each element divided by 2^exponent (exact: a power of two) is rounded to the
nearest e2m1 value, ties to the even code, saturating at +-6, its sign kept (a negative value that
rounds to zero is the code of -0). An all-zero block gets the smallest scale, byte 0 (2^-127), and
the codes of 0 (of -0 for an element -0.0); so does any block whose absmax is below 2^-124 get the
scale byte 0. tests/test_quant_mxfp4.py checks the bytes bit for bit against torchao's MX
conversion (``torchao.prototype.mx_formats.mx_tensor.to_mx``, FLOOR scale mode, fp4 e2m1), which
follows the same rule but for the blocks of scale byte 0 that are not all zero (it divides those
by 2^-126, not by the 2^-127 their byte says), and the round trip: quantizing a dequantized weight
gives its codes and scales back.

Dequantizing (:func:`dequantize_mxfp4`) is the exact fp4(code) x 2^(s - 127), rounded once to the
output dtype: computed in fp32 as (2 fp4(code)) x 2^(s - 128), two fp32 numbers (2^(s - 128), s in
[0, 255], is finite: 2^-128 a subnormal, 2^127 the largest), so the product is exact but where it
overflows to inf (scale byte 255, NaN in the spec, with a code of magnitude 1 or more), as an
ldexp does. Bit for bit what transformers' ``integrations.mxfp4.convert_moe_packed_tensors`` gives
in fp32 and bf16 for every code and scale byte (tests/test_gpt_oss.py, tests/test_quant_mxfp4.py).
It is the one MXFP4 dequantization of the project: the import of a gpt-oss checkpoint into an
unquantized store uses it too (:func:`dequantize_blocks`, the Hub's shapes).

Vectorised over blocks (no Python loop over blocks; a loop over bounded chunks), so the same code
runs on the CPU and, as a handful of kernels, on a GPU.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .quant import CHUNK, DEQUANT_CHUNK, boundaries_below

MX_BLOCK = 32
"""Elements per MXFP4 block (one e8m0 scale each), along a weight's input dimension."""
E8M0_BIAS = 127
"""A scale byte s means 2^(s - E8M0_BIAS)."""
E2M1_EMAX = 2
"""The exponent of e2m1's largest value (6 = 1.5 x 2^2), taken from the block's exponent."""
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The fp4 e2m1 value of each 4-bit code (sign bit 3, two exponent bits, one mantissa bit)."""
_TIE_UP = (0.75, 1.75, 3.5)
"""Midpoints between two e2m1 magnitudes whose tie goes up (to the even code); the others' go down."""


@lru_cache(maxsize=None)
def _tables(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(each byte's two values doubled [256, 2] fp32, low nibble first; 2^(s - 128) [256] fp32 for each
    scale byte s) on ``device``."""
    values = torch.tensor(FP4_VALUES, dtype=torch.float32)
    byte = torch.arange(256)
    pairs = 2 * torch.stack((values[byte & 15], values[byte >> 4]), dim=1)
    powers = torch.tensor([2.0 ** (s - E8M0_BIAS - 1) for s in range(256)], dtype=torch.float64).float()
    return pairs.to(device), powers.to(device)


@lru_cache(maxsize=None)
def _boundaries() -> tuple[float, ...]:
    """The 7 rounding boundaries of the e2m1 magnitudes, fp32 values as Python floats: a magnitude m
    gets the code of the boundaries below it, so a tie that goes up (:data:`_TIE_UP`) has its boundary
    moved to the fp32 number just under it."""
    values = torch.tensor(FP4_VALUES, dtype=torch.float32)
    mids = (values[:7] + values[1:8]) / 2  # 0.25, 0.75, ..., 5
    return tuple(float(torch.nextafter(m, torch.tensor(0.0))) if float(m) in _TIE_UP else float(m) for m in mids)


def mxfp4_bytes(shape: tuple[int, ...]) -> tuple[int, int]:
    """(code bytes, scale bytes) of an MXFP4 weight of ``shape`` [out, in] (``in`` a multiple of
    :data:`MX_BLOCK`; a ValueError otherwise)."""
    rows, cols = shape
    if cols % MX_BLOCK:
        raise ValueError(f"an MXFP4 weight's rows are whole blocks of {MX_BLOCK}; shape {tuple(shape)} is not")
    return rows * cols // 2, rows * cols // MX_BLOCK


def _quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [b, 32] fp32 -> (codes [b * 16] uint8, scale bytes [b] uint8) (see the module docstring)."""
    absmax = x.abs().amax(dim=1)
    floor_log2 = ((absmax.view(torch.int32) >> 23) & 0xFF) - E8M0_BIAS  # the exponent bits (-127 below 2^-126)
    exponent = (floor_log2 - E2M1_EMAX).clamp(-E8M0_BIAS, E8M0_BIAS)
    _, powers = _tables(str(x.device))
    inverse = powers[E8M0_BIAS + 1 - exponent]  # 2^-exponent, a normal fp32 for every exponent in range: exact
    magnitude = x.abs() * inverse.unsqueeze(1)
    codes = boundaries_below(magnitude, _boundaries())  # a NaN gets 7
    codes |= torch.signbit(x).to(torch.uint8) << 3
    codes = codes.view(-1)
    return codes[0::2] | (codes[1::2] << 4), (exponent + E8M0_BIAS).to(torch.uint8)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [out, in] (fp32/bf16/fp16; ``in`` a multiple of 32) -> (codes [out * in / 2] uint8, scales
    [out * in / 32] uint8): MXFP4 by the OCP rule (see the module docstring), row-major."""
    size, blocks = mxfp4_bytes(tuple(w.shape))
    flat = w.detach().reshape(-1)
    codes = torch.empty(size, dtype=torch.uint8, device=w.device)
    scales = torch.empty(blocks, dtype=torch.uint8, device=w.device)
    for a in range(0, flat.numel(), CHUNK):  # a chunk's temporaries stay in cache (CHUNK: whole blocks)
        part = flat[a:a + CHUNK].float().view(-1, MX_BLOCK)
        c, s = _quantize_blocks(part)
        codes[a // 2:a // 2 + c.numel()] = c
        scales[a // MX_BLOCK:a // MX_BLOCK + s.numel()] = s
    return codes, scales


def dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """codes [k, n / 2] uint8, scales [k, n / 32] uint8 -> ``out`` [k, n] (any float dtype, on their
    device): k weights of one shape at once (or each argument without its leading dimension: one),
    each element fp4(code) * 2^(scale - 127), exact in fp32 (see the module docstring), rounded once to
    ``out``'s dtype. Views with any row stride will do."""
    if out.dim() == 1:
        return dequantize_mxfp4(codes[None], scales[None], out[None])[0]
    k, n = out.shape
    blocks = n // MX_BLOCK
    pairs, powers = _tables(str(codes.device))
    step = max(1, DEQUANT_CHUNK // (k * MX_BLOCK))  # blocks at a time: the temporaries stay O(chunk)
    for a in range(0, blocks, step):
        b = min(blocks, a + step)
        values = pairs[codes[:, a * MX_BLOCK // 2:b * MX_BLOCK // 2].long()].view(k, b - a, MX_BLOCK)
        values = values * powers[scales[:, a:b].long()].unsqueeze(2)
        out[:, a * MX_BLOCK:b * MX_BLOCK].copy_(values.view(k, -1))
    return out


def dequantize_blocks(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 (the Hub's gpt-oss shapes) -> [..., G * 32] in
    ``dtype``: :func:`dequantize_mxfp4` of each row."""
    lead, groups = blocks.shape[:-2], blocks.shape[-2]
    rows = blocks.reshape(-1, groups * 16).to(torch.uint8)
    out = torch.empty(rows.shape[0], groups * MX_BLOCK, dtype=dtype, device=blocks.device)
    dequantize_mxfp4(rows, scales.reshape(-1, groups).to(torch.uint8), out)
    return out.view(*lead, groups * MX_BLOCK)
