"""Pinning a store too large for one registration: host memory registered in pieces
(:func:`megatrain_ray.engine.device.pin_in_pieces`), tested on the CPU with a small piece size and
the kernel's own page locking (``mlock``/``munlock``) standing in for ``cudaHostRegister``: the
locked bytes are read back from /proc/self/status (VmLck), so the test sees what really is pinned.
"""

import ctypes
import mmap

import pytest

from megatrain_ray.engine.device import PAGE, pin_in_pieces

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
        pieces = pin_in_pieces(ptr, nbytes, register, None, piece_bytes=16 * PAGE)
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
                          piece_bytes=16 * PAGE)
        except OSError as e:
            pytest.skip(f"mlock is not permitted here ({e})")
    assert str(info.value) == (f"pinning {nbytes} bytes of host memory failed at piece 6 ({16 * PAGE} bytes at offset "
                               f"{5 * 16 * PAGE}): CUDA error 1")
    assert _locked_kib() == before  # the five pieces before it were unpinned


def test_pieces_are_cut_at_page_boundaries_of_an_unaligned_block():
    seen = []
    ptr = 10 * PAGE + 100  # a unit's block inside a mapping starts anywhere
    pin_in_pieces(ptr, 5 * PAGE, lambda p, n: seen.append((p, n)), None, piece_bytes=2 * PAGE)
    assert [p for p, _ in seen] == [ptr, 12 * PAGE, 14 * PAGE]
    assert all(p % PAGE == 0 for p, _ in seen[1:]) and sum(n for _, n in seen) == 5 * PAGE
    with pytest.raises(ValueError):
        pin_in_pieces(ptr, PAGE, lambda p, n: None, None, piece_bytes=PAGE + 1)
