"""The quantized base formats (megatrain_ray.model.quant) bit for bit against bitsandbytes' CPU backend.

Quantizing with our torch code gives bitsandbytes' bytes (codes, absmax codes, absmax2, offset) for
NF4 with double quantization and for int8 row-wise, and dequantizing gives bitsandbytes' weights, in
fp32 and bf16. One caveat of bitsandbytes itself: its AVX-512 CPU kernel indexes the absmax of a
weight whose rows are not a whole number of 64-blocks as if every row started a block (a wrong
weight), so for such shapes the reference is bitsandbytes' torch implementation of the same
arithmetic (its default backend), which its CUDA kernel agrees with.
"""

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
F = pytest.importorskip("bitsandbytes.functional")

from megatrain_ray.model import quant as Q  # noqa: E402

SHAPES = [(64, 128), (96, 64), (700, 192), (3, 1000), (1, 64 * 257 + 10), (5, 7), (5, 60010)]  # the last: chunks


def _weight(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    w.view(-1)[0] = 0.5  # an outlier, so the absmax spread is wide
    w.view(-1)[-3:] = 0.0
    return w.to(dtype)


def _bnb_dequantize(packed, state):
    """bitsandbytes' NF4 weight (flat); its torch reference where its AVX-512 kernel mis-indexes (see above)."""
    shape = state.shape
    if shape[-1] % Q.NF4_BLOCK == 0 or len(shape) == 1:
        return F.dequantize_4bit(packed, state).reshape(-1)
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
    return _dequantize_4bit_compute.__wrapped__(packed.reshape(-1), absmax, _get_4bit_code("nf4", packed.device),
                                                state.blocksize, state.shape, state.dtype).reshape(-1)


def test_tables_are_bitsandbytes():
    assert torch.equal(Q.dynamic_map(), F.create_dynamic_map(signed=True))
    assert torch.equal(torch.tensor(Q.NF4_LEVELS), F.get_4bit_type("nf4", device="cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_nf4_is_bitsandbytes_bit_for_bit(shape, dtype):
    w = _weight(shape, dtype)
    packed, state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    ours = Q.quantize_nf4(w, use_bnb=False)
    codes, qabsmax, absmax2, offset = ours
    assert codes.numel() == Q.nf4_bytes(w.numel())[0] and torch.all(codes[packed.numel():] == Q.PAD_BYTE)
    assert torch.equal(codes[:packed.numel()], packed.view(-1))
    assert torch.equal(qabsmax, state.absmax)
    assert torch.equal(absmax2, state.state2.absmax)
    assert torch.equal(offset, state.offset.view(1).float())
    for a, b in zip(ours, Q.quantize_nf4(w, use_bnb=True)):  # through bitsandbytes on request: the same
        assert torch.equal(a, b)
    out = torch.full((w.numel(),), float("nan"), dtype=dtype)
    Q.dequantize_nf4(*ours, out)
    assert torch.equal(out, _bnb_dequantize(packed, state).to(dtype))
    assert (out - w.reshape(-1).float()).abs().max() < 0.1 * w.abs().max()  # and it is the weight, roughly


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_is_bitsandbytes_bit_for_bit(dtype):
    w = _weight((96, 160), dtype)
    codes, stats, _ = F.int8_vectorwise_quant(w.clone())
    ours = Q.quantize_int8(w, use_bnb=False)
    assert torch.equal(ours[0], codes.view(-1)) and torch.equal(ours[1], stats.float())
    assert all(torch.equal(a, b) for a, b in zip(ours, Q.quantize_int8(w, use_bnb=True)))  # on request: the same
    out = torch.empty(w.numel(), dtype=dtype)
    Q.dequantize_int8(*ours, out)
    assert torch.equal(out, F.int8_vectorwise_dequant(codes, stats).to(dtype).view(-1))


def test_zero_blocks_are_bitsandbytes_too():
    for w in (torch.zeros(3 * 64), torch.zeros(300 * 64)):
        w[70] = 1.0
        packed, state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
        ours = Q.quantize_nf4(w, use_bnb=False)
        assert torch.equal(ours[0][:packed.numel()], packed.view(-1)) and torch.equal(ours[1], state.absmax)
        out = torch.empty(w.numel())
        assert torch.equal(Q.dequantize_nf4(*ours, out), F.dequantize_4bit(packed, state).view(-1))
        assert torch.equal(out[:64], torch.zeros(64))  # level 0.0 times any absmax


def test_dequantization_in_chunks_is_whole(monkeypatch):
    w = _weight((37, 1000), torch.float32)
    nf4, int8 = Q.quantize_nf4(w, use_bnb=False), Q.quantize_int8(w, use_bnb=False)
    whole = (Q.dequantize_nf4(*nf4, torch.empty(w.numel())), Q.dequantize_int8(*int8, torch.empty(w.numel())))
    monkeypatch.setattr(Q, "DEQUANT_CHUNK", 3 * Q.NF4_BLOCK)  # 3 blocks (or rows) at a time, a partial last
    assert torch.equal(Q.dequantize_nf4(*nf4, torch.empty(w.numel())), whole[0])
    assert torch.equal(Q.dequantize_int8(*int8, torch.empty(w.numel())), whole[1])


def test_levels_and_midpoints_are_picked_as_bitsandbytes_picks_them():
    """Values at the NF4 levels, at the fp32 midpoints between them and at the fp32 numbers either side
    of each midpoint (blocks whose absmax is 1, so the scaled value is the value itself)."""
    levels = torch.tensor(Q.NF4_LEVELS, dtype=torch.float32)
    mids = (levels[:-1] + levels[1:]) / 2
    values = torch.cat([levels, mids, torch.nextafter(mids, torch.tensor(-2.0)), torch.nextafter(mids, torch.tensor(2.0))])
    w = torch.cat([torch.cat([torch.ones(1), part]) for part in values.split(63)])  # each block's absmax: 1.0
    packed, state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    assert torch.equal(Q.quantize_nf4(w, use_bnb=False)[0][:packed.numel()], packed.view(-1))
