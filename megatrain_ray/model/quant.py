"""The quantized base formats' arithmetic, in bitsandbytes' layouts, as torch ops on any device.

A LoRA run's frozen base may be stored quantized (lora.base_format); the formats and their bytes:

- ``nf4``: QLoRA's 4-bit NormalFloat with double quantization, as
  ``bitsandbytes.functional.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")``
  stores a weight: each block of :data:`NF4_BLOCK` elements is scaled by its absolute maximum and
  each element becomes the index of the nearest of the 16 NF4 levels (:data:`NF4_LEVELS`), two per
  byte, the first in the high nibble; the blocks' absmax (fp32) are stored minus their mean (the
  ``offset``) as 8-bit codes of bitsandbytes' signed dynamic map (:func:`dynamic_map`), scaled per
  :data:`STATS_BLOCK` absmax by an fp32 ``absmax2``. Per element: 0.5 + 1/64 + 4/16384 bytes.
- ``int8``: LLM.int8()'s weight storage (``bitsandbytes.functional.int8_vectorwise_quant``, what
  ``Linear8bitLt`` holds as ``CB`` and ``SCB``): each row rounded to int8 after scaling by 127 / its
  absolute maximum, which is kept as an fp32 per row. Per element: 1 + 4 / columns bytes.

Dequantizing (:func:`dequantize_nf4`, :func:`dequantize_int8`) gives, bit for bit, what
``bitsandbytes.functional.dequantize_4bit`` and ``int8_vectorwise_dequant`` give (tests/test_quant.py
checks both against bitsandbytes' CPU backend): the arithmetic is bitsandbytes' own, in fp32, rounded
once to the output dtype. Quantizing (:func:`quantize_nf4`, :func:`quantize_int8`) runs this
module's torch version, checked bit-identical to bitsandbytes' (its CPU backend quantizes NF4 about
5x slower per core, ~180 against ~35 ns a weight: minutes more for a 70B base at load), or
bitsandbytes itself on request (``use_bnb``).

Every function works on flat tensors of one weight and is vectorised over blocks (no Python loop
over blocks), so the same code dequantizes on the CPU and, as a handful of kernels, on a GPU.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

NF4_BLOCK = 64
"""Elements per NF4 block (one absmax each)."""
STATS_BLOCK = 256
"""NF4 absmax per block of the double quantization (one fp32 absmax2 each)."""
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)
"""The 16 NF4 levels of QLoRA (quantiles of a standard normal, normalised to [-1, 1]), ascending."""
PAD_BYTE = 0x77
"""Two NF4 codes of 0.0: the padding of a weight to whole blocks (bitsandbytes pads an odd count so too)."""
CHUNK = 1 << 18
"""Elements quantized at a time (a multiple of :data:`NF4_BLOCK`), so that the temporaries stay in cache."""
DEQUANT_CHUNK = 1 << 24
"""Elements dequantized by one set of kernels at most: the fp32 temporaries of a chunk stay ~200 MB."""
INT8_SCALE = 7.874015718698502e-3
"""bitsandbytes' 1/127 of the int8 dequantization (the fp32 number it multiplies by)."""


def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (``create_dynamic_map(signed=True)``), 256 fp32 values
    ascending: for decade k = 0..6, the midpoints of 2^k + 1 evenly spaced points in [0.1, 1], times
    10^(k-6) (in fp32), with both signs; then 0 and 1, and zeros to fill 256."""
    values: list[float] = []
    for k in range(7):
        points = torch.linspace(0.1, 1, 2 ** k + 1, dtype=torch.float32)
        mids = (points[:-1] + points[1:]) / 2.0
        values += (10 ** (k - 6) * mids).tolist() + (-(10 ** (k - 6)) * mids).tolist()  # scaled in fp32
    values += [0.0, 1.0]
    values += [0.0] * (256 - len(values))
    return torch.tensor(sorted(values), dtype=torch.float32)


@lru_cache(maxsize=None)
def _tables(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(each byte's two NF4 levels [256, 2] high nibble first, dynamic map [256]) on ``device``."""
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32)
    byte = torch.arange(256)
    pairs = torch.stack((levels[byte >> 4], levels[byte & 15]), dim=1)
    return pairs.to(device), dynamic_map().to(device)


def nf4_bytes(numel: int) -> tuple[int, int, int]:
    """(code bytes, absmax codes, absmax2 values) of an NF4 weight of ``numel`` elements, padded to
    whole blocks of :data:`NF4_BLOCK` (the padding's codes are those of 0.0, :data:`PAD_BYTE`, never read back)."""
    blocks = -(-numel // NF4_BLOCK)
    return blocks * NF4_BLOCK // 2, blocks, -(-blocks // STATS_BLOCK)


@lru_cache(maxsize=None)
def _midpoints() -> tuple[float, ...]:
    """The 15 midpoints between neighbouring NF4 levels, each rounded to fp32, as Python floats."""
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32)
    return tuple(((levels[:-1] + levels[1:]) / 2).tolist())


def boundaries_below(x: torch.Tensor, boundaries: tuple[float, ...]) -> torch.Tensor:
    """x: any shape, fp32 -> uint8 of its shape: how many of the ascending ``boundaries`` (fp32 values
    as Python floats) are below each value, counted as their number less those at or above it (a NaN,
    above none, gets their number, as torch.bucketize gives it); a comparison per boundary runs
    ~2.5-3x faster than torch.bucketize for the few boundaries of a 4-bit code."""
    codes = torch.full(x.shape, len(boundaries), dtype=torch.uint8, device=x.device)
    for boundary in boundaries:
        codes.sub_((x <= boundary).view(torch.uint8))
    return codes


def _nearest(scaled: torch.Tensor) -> torch.Tensor:
    """scaled: any shape, fp32 in [-1, 1] -> uint8 of its shape: the index of the nearest NF4 level
    (a tie to the lower), how bitsandbytes picks a weight's level: the midpoints below the value."""
    return boundaries_below(scaled, _midpoints())


LUT_SIZE = 65536
"""Bins of [-1, 1] in bitsandbytes' CPU lookup of an 8-bit code (see :func:`_binned`)."""


@lru_cache(maxsize=None)
def _bins(device: str) -> torch.Tensor:
    """[LUT_SIZE] int64: the dynamic map's code of each bin of [-1, 1] (that of its left edge)."""
    table = dynamic_map()
    mids = 0.5 * (table[:-1] + table[1:])
    edges = -1.0 + (2.0 * torch.arange(LUT_SIZE, dtype=torch.float32)) / (LUT_SIZE - 1)
    return torch.searchsorted(mids, edges).to(device)


def _binned(scaled: torch.Tensor) -> torch.Tensor:
    """The dynamic map's code of each value in [-1, 1] as bitsandbytes' CPU backend picks it (the
    double quantization's absmax codes): the code of the nearest of 65536 evenly spaced bins, each
    op rounded in fp32 as its C code does. (Its CUDA kernel searches the map instead, which can pick
    the code next to this one near a midpoint: a base quantized there has those codes as stored, and
    dequantizes by the same arithmetic.)"""
    index = ((scaled.clamp(-1, 1) + 1.0) * 0.5 * (LUT_SIZE - 1) + 0.5).to(torch.int64)
    return _bins(str(scaled.device))[index]


def _blockwise(x: torch.Tensor, block: int, pick, zero_code: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [n] fp32 -> (codes [ceil(n / block) * block] int (the padding's: those of 0), absmax [ceil(n / block)] fp32): each block scaled by the reciprocal
    of its absolute maximum, clamped to [-1, 1], coded by ``pick`` (an all-zero block's by ``zero_code`` where given, as bitsandbytes' C code does)."""
    n = x.numel()
    padded = torch.nn.functional.pad(x, (0, -n % block)).view(-1, block)
    absmax = padded.abs().amax(dim=1)
    scaled = torch.clamp(padded * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(1), -1, 1)
    codes = pick(scaled)
    if zero_code is not None:
        codes = torch.where(absmax.unsqueeze(1) > 0, codes, zero_code)
    return codes.view(-1), absmax


def _bnb():
    """bitsandbytes.functional, or None where it is not importable."""
    try:
        import bitsandbytes.functional as F
    except Exception:  # not installed, or no backend for this machine
        return None
    return F


def quantize_nf4(w: torch.Tensor, use_bnb: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: any shape, fp32/bf16/fp16 -> (codes [blocks * 32] uint8, absmax codes [blocks] uint8, absmax2
    [ceil(blocks / 256)] fp32, offset [1] fp32): bitsandbytes' NF4 with double quantization (see the
    module docstring); ``use_bnb``: through bitsandbytes where it is importable (same bits, slower)."""
    F = _bnb() if use_bnb else None
    n = w.numel()
    size, _, _ = nf4_bytes(n)
    if F is not None:
        packed, state = F.quantize_4bit(w.detach().reshape(-1).contiguous().cpu(), blocksize=NF4_BLOCK,
                                        compress_statistics=True, quant_type="nf4")
        codes = torch.full((size,), PAD_BYTE, dtype=torch.uint8)
        codes[:packed.numel()] = packed.view(-1)
        return codes, state.absmax.view(-1), state.state2.absmax.view(-1).float(), state.offset.view(1).float()
    flat, codes = w.detach().reshape(-1), torch.empty(size, dtype=torch.uint8, device=w.device)
    absmax = torch.empty(size // (NF4_BLOCK // 2), dtype=torch.float32, device=w.device)
    for a in range(0, n, CHUNK):  # a chunk's temporaries stay in cache
        q, amax = _blockwise(flat[a:a + CHUNK].float(), NF4_BLOCK, _nearest)
        codes[a // 2:a // 2 + q.numel() // 2] = (q[0::2] << 4) | q[1::2]
        absmax[a // NF4_BLOCK:a // NF4_BLOCK + amax.numel()] = amax
    offset = absmax.mean()
    qabs, absmax2 = _blockwise(absmax - offset, STATS_BLOCK, _binned, zero_code=0)
    return codes, qabs[:absmax.numel()].to(torch.uint8), absmax2, offset.view(1)


def dequantize_nf4(codes: torch.Tensor, qabsmax: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor,
                   out: torch.Tensor) -> torch.Tensor:
    """codes [k, >= blocks * 32] uint8, qabsmax [k, blocks] uint8, absmax2 [k, ceil(blocks / 256)] fp32,
    offset [k, 1] fp32 -> ``out`` [k, n] (any float dtype, on their device; blocks = ceil(n / 64)): k
    weights of one shape at once (or each argument without its leading dimension: one), each filled
    with what bitsandbytes' ``dequantize_4bit`` gives: level * (dynamic[qabsmax] * absmax2 + offset),
    in fp32, rounded once to ``out``'s dtype. Views with any row stride will do."""
    if out.dim() == 1:
        return dequantize_nf4(codes[None], qabsmax[None], absmax2[None], offset.view(1, 1), out[None])[0]
    k, n = out.shape
    blocks = qabsmax.shape[1]
    pairs, dyn = _tables(str(codes.device))
    absmax = dyn[qabsmax.long()] * absmax2.repeat_interleave(STATS_BLOCK, dim=1)[:, :blocks] + offset
    step = max(1, DEQUANT_CHUNK // (k * NF4_BLOCK))  # blocks at a time: the temporaries stay O(chunk)
    for a in range(0, blocks, step):
        b = min(blocks, a + step)
        values = pairs[codes[:, a * NF4_BLOCK // 2:b * NF4_BLOCK // 2].long()].view(k, b - a, NF4_BLOCK)
        values = (values * absmax[:, a:b].unsqueeze(2)).view(k, -1)
        out[:, a * NF4_BLOCK:min(n, b * NF4_BLOCK)].copy_(values[:, :min(n, b * NF4_BLOCK) - a * NF4_BLOCK])
    return out


def quantize_int8(w: torch.Tensor, use_bnb: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [rows, cols] -> (codes [rows * cols] int8, row absmax [rows] fp32): LLM.int8()'s weight storage
    (``int8_vectorwise_quant`` without outliers); ``use_bnb``: through bitsandbytes where importable (same bits)."""
    F = _bnb() if use_bnb else None
    w2 = w.detach().reshape(w.shape[0], -1)
    if F is not None:
        codes, stats, _ = F.int8_vectorwise_quant(w2.cpu().contiguous())
        return codes.reshape(-1), stats.float()
    stats = w2.abs().amax(dim=1).float()
    codes = torch.round(w2 * (127.0 / stats.unsqueeze(-1))).to(torch.int8)
    return codes.reshape(-1), stats


def dequantize_int8(codes: torch.Tensor, stats: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """codes [k, rows * cols] int8, stats [k, rows] fp32 -> ``out`` [k, rows * cols]: k weights of one
    shape (or each without its leading dimension: one), filled with what bitsandbytes'
    ``int8_vectorwise_dequant`` gives: codes * absmax * (1/127) in fp32, rounded once."""
    if out.dim() == 1:
        return dequantize_int8(codes[None], stats[None], out[None])[0]
    k, rows = stats.shape
    cols = out.shape[1] // rows
    step = max(1, DEQUANT_CHUNK // (k * cols))  # rows at a time
    for a in range(0, rows, step):
        b = min(rows, a + step)
        part = codes[:, a * cols:b * cols].reshape(k, b - a, cols).float() * stats[:, a:b].unsqueeze(2) * INT8_SCALE
        out[:, a * cols:b * cols].copy_(part.view(k, -1))
    return out


def int8_bytes(shape: tuple[int, ...]) -> tuple[int, int]:
    """(code bytes, row absmax values) of an int8 weight of ``shape``."""
    return math.prod(shape), shape[0]
