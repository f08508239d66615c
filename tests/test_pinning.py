"""Pinning a store too large for one registration: host memory registered in pieces
(:func:`megatrain_ray.engine.compute.device.pin_in_pieces`), tested on the CPU with a small piece size and
the kernel's own page locking (``mlock``/``munlock``) standing in for ``cudaHostRegister``: the
locked bytes are read back from /proc/self/status (VmLck), so the test sees what really is pinned.
A piece ends only where a block starts, so no copy of a block runs from one registration into the next
(the driver refuses such a copy: "invalid argument"); the store's arrays are checked so at the sizes
where that happened (80 and 100 layers of the 32B width, a LoRA run's bf16 base past 64 GiB).
"""

import ctypes
import mmap

import pytest
import torch

from megatrain_ray.engine.compute.device import PAGE, PIN_PIECE_BYTES, pin_in_pieces
from megatrain_ray.engine.store.host_store import StoreSpec
from megatrain_ray.model.layout import StoreLayout
from megatrain_ray.model.precision import Precision
from megatrain_ray.model.presets import preset_model
from megatrain_ray.config import LoraSection

PAGES = [k * PAGE for k in range(2**20 // PAGE + 3)]
"""Block starts of the test mapping: a block per page."""

libc = ctypes.CDLL(None, use_errno=True)


def _locked_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmLck:"))


def _lock(ptr: int, n: int) -> None:
    if libc.mlock(ctypes.c_void_p(ptr), ctypes.c_size_t(n)) != 0:
        raise OSError(ctypes.get_errno(), "mlock failed")


@pytest.fixture
def mapping():
    """1 MiB + 3 pages of real shared memory (an anonymous shared mapping, as /dev/shm's are shared)."""
    m = mmap.mmap(-1, 2**20 + 3 * PAGE, flags=mmap.MAP_SHARED)
    buf = (ctypes.c_char * len(m)).from_buffer(m)
    yield ctypes.addressof(buf), len(m)
    del buf
    m.close()


def test_a_mapping_is_pinned_in_pieces_and_all_of_it_is_pinned(mapping):
    ptr, nbytes = mapping
    before = _locked_kib()
    seen = []

    def register(p, n):
        seen.append((p - ptr, n))
        _lock(p, n)

    try:
        pieces = pin_in_pieces(ptr, nbytes, register, None, piece_bytes=16 * PAGE, cuts=PAGES)
    except OSError as e:
        pytest.skip(f"mlock is not permitted here ({e})")
    try:
        assert len(pieces) == -(-nbytes // (16 * PAGE)) == 17
        assert [o for o, _ in seen] == [k * 16 * PAGE for k in range(17)] and seen[-1][1] == 3 * PAGE
        assert sum(n for _, n in seen) == nbytes  # every byte once, no page in two pieces
        assert _locked_kib() - before == nbytes // 1024
    finally:
        for p, (_, n) in zip(pieces, seen):
            libc.munlock(ctypes.c_void_p(p), ctypes.c_size_t(n))
    assert _locked_kib() == before


def test_a_piece_that_fails_leaves_nothing_pinned_and_names_the_piece(mapping):
    ptr, nbytes = mapping
    before = _locked_kib()
    sizes = {}

    def register(p, n):
        if p - ptr == 5 * 16 * PAGE:
            raise RuntimeError("CUDA error 1")  # as a driver refusing a registration
        _lock(p, n)
        sizes[p] = n

    with pytest.raises(RuntimeError) as info:
        try:
            pin_in_pieces(ptr, nbytes, register, lambda p: libc.munlock(ctypes.c_void_p(p), ctypes.c_size_t(sizes[p])),
                          piece_bytes=16 * PAGE, cuts=PAGES)
        except OSError as e:
            pytest.skip(f"mlock is not permitted here ({e})")
    assert str(info.value) == (f"pinning {nbytes} bytes of host memory failed at piece 6 ({16 * PAGE} bytes at offset "
                               f"{5 * 16 * PAGE}): CUDA error 1")
    assert _locked_kib() == before  # the five pieces before it were unpinned


def test_pieces_end_only_where_a_block_starts():
    seen = []
    ptr = 10 * PAGE  # blocks of 3, 2, 4 and 1 pages
    pin_in_pieces(ptr, 10 * PAGE, lambda p, n: seen.append((p - ptr, n)), None, piece_bytes=5 * PAGE,
                  cuts=[0, 3 * PAGE, 5 * PAGE, 9 * PAGE])
    assert seen == [(0, 5 * PAGE), (5 * PAGE, 5 * PAGE)]
    seen.clear()
    pin_in_pieces(ptr, 10 * PAGE, lambda p, n: seen.append((p - ptr, n)), None, piece_bytes=4 * PAGE,
                  cuts=[0, 3 * PAGE, 5 * PAGE, 9 * PAGE])
    assert seen == [(0, 3 * PAGE), (3 * PAGE, 2 * PAGE), (5 * PAGE, 4 * PAGE), (9 * PAGE, PAGE)]
    seen.clear()  # a block larger than a piece is a piece of its own; no cuts: one piece
    pin_in_pieces(ptr, 10 * PAGE, lambda p, n: seen.append((p - ptr, n)), None, piece_bytes=2 * PAGE,
                  cuts=[0, PAGE, 8 * PAGE])
    assert seen == [(0, PAGE), (PAGE, 7 * PAGE), (8 * PAGE, 2 * PAGE)]
    seen.clear()
    pin_in_pieces(ptr, 10 * PAGE, lambda p, n: seen.append((p - ptr, n)), None, piece_bytes=2 * PAGE)
    assert seen == [(0, 10 * PAGE)]
    with pytest.raises(ValueError):
        pin_in_pieces(ptr, PAGE, lambda p, n: None, None, piece_bytes=PAGE + 1)
    with pytest.raises(ValueError, match="inside a page"):
        pin_in_pieces(ptr, 4 * PAGE, lambda p, n: None, None, piece_bytes=2 * PAGE, cuts=[PAGE + 8])


@pytest.mark.parametrize("layers", [64, 80, 100])
def test_no_unit_of_a_large_lora_base_straddles_two_registrations(layers):
    """The 32B width's bf16 base crosses the 64 GiB piece size inside layers.68 from 70 layers on:
    pinned as the compute worker pins it, every unit's block lies in exactly one registration."""
    model = preset_model("32b", layers)
    bf16 = Precision(master=torch.bfloat16, compute=torch.bfloat16)
    spec = StoreSpec(model, bf16, "/dev/shm", 0, "x", lora=LoraSection(rank=16))
    layout, size = StoreLayout.build(model), 2
    pieces = []
    pin_in_pieces(0, spec.numel("master") * size, lambda p, n: pieces.append((p, p + n)), None,
                  cuts=[s * size for s in spec.block_starts("master")])
    assert pieces[0][0] == 0 and pieces[-1][1] == spec.numel("master") * size
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])) and all(b - a <= PIN_PIECE_BYTES for a, b in pieces)
    assert len(pieces) == (1 if layers == 64 else 2)
    for i, unit in enumerate(layout.records):
        start, stop = layout.offsets[i] * size, (layout.offsets[i] + layout.templates[i].numel) * size
        assert any(a <= start and stop <= b for a, b in pieces), f"{unit.name} straddles two registrations"


def test_no_unit_of_a_quantized_base_straddles_two_registrations():
    """A quantized base's array holds each unit's bytes (megatrain_ray.model.quant_layout): its
    registrations are cut where those start, whatever the piece size."""
    from megatrain_ray.model.quant_layout import QuantLayout

    model = preset_model("small", 4)
    spec = StoreSpec(model, Precision(master=torch.bfloat16, compute=torch.bfloat16), "/dev/shm", 0, "x",
                     lora=LoraSection(rank=4, base_format="nf4"))
    quant = QuantLayout.build(model, "nf4", torch.bfloat16)
    pieces = []
    pin_in_pieces(0, spec.numel("master"), lambda p, n: pieces.append((p, p + n)), None, piece_bytes=16 * PAGE,
                  cuts=spec.block_starts("master"))
    assert len(pieces) > 1 and pieces[-1][1] == spec.numel("master")
    for i, unit in enumerate(quant.units):
        start, stop = quant.offsets[i], quant.offsets[i] + unit.nbytes
        assert any(a <= start and stop <= b for a, b in pieces), f"unit {i} straddles two registrations"
