"""The device-specific part of the compute worker, behind one small interface.

A backend owns the device weight slots and the two copy directions:

- ``load(slot, host_block, label, ranges)``: start copying a unit's streamed weights into a slot
  (all of them, or only the (start, end) element ``ranges``: the parts of a sparse layer the
  step's routing uses, one copy per range); returns a handle that ``wait`` turns into "the compute
  may read the slot now";
- ``release(slot)``: the compute is done reading the slot (a later load may overwrite it);
- ``store(dev, host_block, scalar, label, ranges)``: start copying a device tensor (a gradient, or
  its ``ranges``) to the host, with a device scalar (its squared norm); returns a handle whose ``result()`` blocks until the
  host bytes are complete and returns the scalar as a float; ``scalar(value)``: the same for a
  device scalar alone;
- ``compute(label)``: a context around one unit's compute;
- ``beside(after, tensors)``: a context whose device work runs beside the compute, after its point
  ``after`` (a ``mark()``), reading ``tensors`` the compute made (the streamed units' device updates);
- ``begin_step()`` / ``end_step()``: the step's timeline, as (lane, label, start, end) intervals in
  wall-clock seconds, for lanes ``h2d``, ``compute`` and ``d2h``.

:class:`CpuBackend` does plain synchronous copies. :class:`CudaBackend` registers the host store's
shared memory as pinned memory once (``cudaHostRegister``) and runs H2D and D2H on their own
streams, ordered against the compute stream with events, so the host never synchronises in the
steady state except where a gradient must be complete before its ticket is sent.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Sequence
import threading
import time

import torch


PAGE = 4096
PIN_PIECE_BYTES = 64 * 2**30
"""The most host memory pinned by one ``cudaHostRegister`` call: some drivers refuse a single
registration of 512 GiB or more, so a larger store is registered piece by piece."""


def pin_in_pieces(ptr: int, nbytes: int, register, unregister, piece_bytes: int = PIN_PIECE_BYTES,
                  cuts: Sequence[int] = ()) -> list[int]:
    """Register ``nbytes`` of host memory at ``ptr`` with ``register(ptr, n)`` as consecutive pieces of
    at most ``piece_bytes`` (a multiple of the 4 KiB page); returns the pieces' pointers (for
    ``unregister(ptr)`` at close). A piece that fails unregisters those before it, so nothing stays
    pinned, and raises one RuntimeError naming the piece.

    A piece ends only at one of ``cuts`` (byte offsets from ``ptr`` where a block of the memory
    starts, e.g. every unit's block of a store array) or at the end: the driver refuses an
    asynchronous copy whose source or destination runs from one registration into the next
    ("invalid argument"), so no block that is copied in one piece may straddle two pieces. Without
    ``cuts`` the whole memory is one block. A block larger than ``piece_bytes`` is registered as a
    piece of its own (the driver then decides whether it takes it). The cuts must lie on page
    boundaries (a ValueError otherwise), so that no page belongs to two pieces."""
    if piece_bytes <= 0 or piece_bytes % PAGE:
        raise ValueError(f"piece_bytes must be a positive multiple of {PAGE}, got {piece_bytes}")
    ends = sorted({c for c in cuts if 0 < c < nbytes} | {nbytes})
    done: list[int] = []
    start = 0
    while start < nbytes:
        first = bisect.bisect_right(ends, start)  # the first end past start
        stop = ends[max(first, bisect.bisect_right(ends, start + piece_bytes) - 1)]
        if stop < nbytes and (ptr + stop) % PAGE:
            raise ValueError(f"a registration would end inside a page (offset {stop}): blocks of pinned memory "
                             f"must start on {PAGE}-byte pages")
        try:
            register(ptr + start, stop - start)
        except Exception as e:
            for p in reversed(done):
                unregister(p)
            raise RuntimeError(f"pinning {nbytes} bytes of host memory failed at piece {len(done) + 1} ("
                               f"{stop - start} bytes at offset {start}): {e}") from None
        done.append(ptr + start)
        start = stop
    return done


class _Intervals:
    """Thread-safe list of (lane, label, start, end) records of the current step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[tuple] = []

    def add(self, *item) -> None:
        with self._lock:
            self._items.append(item)

    def take(self) -> list[tuple]:
        with self._lock:
            items, self._items = self._items, []
        return items


class CpuBackend:
    """Slots in ordinary memory; every copy completes before it returns."""

    name = "cpu"

    def __init__(self, num_slots: int, slot_numel: int, dtype: torch.dtype):
        self.device = torch.device("cpu")
        self.slots = [torch.empty(slot_numel, dtype=dtype) for _ in range(num_slots)]
        self._intervals = _Intervals()

    def register_host(self, tensor: torch.Tensor, starts: Sequence[int] = ()) -> None:
        """Nothing to pin on the CPU."""

    def load(self, slot: int, host: torch.Tensor, label: str = "", ranges=None) -> None:
        t0 = time.time()
        pairs = _pieces(self.slots[slot], host, ranges)
        for dev, src in pairs:
            dev.copy_(src)
        self._intervals.add("h2d", label, t0, time.time(), _nbytes(pairs))

    def wait(self, handle: None) -> None:
        pass

    def release(self, slot: int) -> None:
        pass

    def store(self, dev: torch.Tensor, host: torch.Tensor, scalar: torch.Tensor, label: str = "",
              ranges=None) -> "_Done":
        t0 = time.time()
        pairs = _pieces(dev, host, ranges)
        for src, dst in pairs:
            dst.copy_(src)
        self._intervals.add("d2h", label, t0, time.time(), _nbytes(pairs))
        return _Done(float(scalar))

    def scalar(self, value: torch.Tensor) -> "_Done":
        return _Done(float(value))

    @contextlib.contextmanager
    def compute(self, label: str):
        t0 = time.time()
        yield
        self._intervals.add("compute", label, t0, time.time(), 0)

    @contextlib.contextmanager
    def beside(self, after: None, tensors=()):
        """The CPU runs what the calling thread does as it comes: nothing to order."""
        yield

    def host_buffer(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def stash(self, dev: torch.Tensor, host: torch.Tensor, label: str = "") -> None:
        """Copy an activation out to a host buffer (see :mod:`megatrain_ray.engine.compute.activations`)."""
        t0 = time.time()
        host.copy_(dev)
        self._intervals.add("d2h", label, t0, time.time(), host.numel() * host.element_size())

    def unstash(self, host: torch.Tensor, done: None, label: str = "", into: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, None]:
        """A device copy of a stashed activation (in ``into`` where given), and the handle to :meth:`wait` on before use."""
        t0 = time.time()
        dev = host.clone() if into is None else into.copy_(host)
        self._intervals.add("h2d", label, t0, time.time(), host.numel() * host.element_size())
        return dev, None

    def mark(self) -> None:
        """A point in the compute stream that :meth:`host_wait` can wait for (nothing to wait for here)."""
        return None

    def host_wait(self, mark: None) -> None:
        pass

    def note(self, lane: str, label: str, start: float, end: float) -> None:
        """Record a host-side span (e.g. the compute thread waiting for weights)."""
        self._intervals.add(lane, label, start, end, 0)

    def begin_step(self) -> None:
        self._intervals.take()

    def peak_bytes(self) -> int:
        return 0

    def alloc_retries(self) -> int:
        return 0

    def end_step(self) -> list[tuple]:
        return self._intervals.take()

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass


def _pieces(a: torch.Tensor, b: torch.Tensor, ranges) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(a's, b's) views of each (start, end) element range of ``ranges`` (None: b's elements, whole)."""
    if ranges is None:
        return [(a[:b.numel()], b)]
    return [(a[lo:hi], b[lo:hi]) for lo, hi in ranges]


def _nbytes(pairs) -> int:
    return sum(t.numel() * t.element_size() for _, t in pairs)


class _Done:
    def __init__(self, value: float):
        self.value = value

    def result(self) -> float:
        return self.value


class CudaBackend:
    """Slots in GPU memory; copies on dedicated streams, ordered with events."""

    name = "cuda"

    def __init__(self, num_slots: int, slot_numel: int, dtype: torch.dtype, device_index: int = 0):
        self.device = torch.device("cuda", device_index)
        torch.cuda.set_device(self.device)
        self.slots = [torch.empty(slot_numel, dtype=dtype, device=self.device) for _ in range(num_slots)]
        self.h2d = torch.cuda.Stream(self.device)
        self.d2h = torch.cuda.Stream(self.device)
        self.side = torch.cuda.Stream(self.device)
        """The stream of work run :meth:`beside` the compute."""
        self._slot_free = [None] * num_slots
        self._registered: list[int] = []
        self._intervals = _Intervals()
        self._origin = (time.time(), self._event())

    @staticmethod
    def _event(blocking: bool = False) -> torch.cuda.Event:
        """A timing event recorded on the current stream; ``blocking`` ones are for the host to
        wait on: the waiting thread sleeps instead of spinning a core that the AdamW threads need."""
        ev = torch.cuda.Event(enable_timing=True, blocking=blocking)
        ev.record()
        return ev

    def register_host(self, tensor: torch.Tensor, starts: Sequence[int] = (),
                      piece_bytes: int = PIN_PIECE_BYTES) -> None:
        """Pin a shared-memory mapping once so copies from/to it run at full link speed (in pieces of
        at most ``piece_bytes``, each cut where a block starts: ``starts``, element offsets of the
        tensor's blocks, none of which a copy crosses; :func:`pin_in_pieces`)."""
        if tensor.numel() == 0:
            return
        cudart = torch.cuda.cudart()

        def register(ptr: int, n: int) -> None:
            err = cudart.cudaHostRegister(ptr, n, 0)
            if int(err) != 0:
                raise RuntimeError(f"CUDA error {int(err)}")

        size = tensor.element_size()
        self._registered += pin_in_pieces(tensor.data_ptr(), tensor.numel() * size, register,
                                          lambda ptr: cudart.cudaHostUnregister(ptr), piece_bytes,
                                          [s * size for s in starts])

    def load(self, slot: int, host: torch.Tensor, label: str = "", ranges=None) -> torch.cuda.Event:
        pairs = _pieces(self.slots[slot], host, ranges)
        with torch.cuda.stream(self.h2d):
            if self._slot_free[slot] is not None:
                self.h2d.wait_event(self._slot_free[slot])
            start = self._event()
            for dev, src in pairs:
                dev.copy_(src, non_blocking=True)
            ready = self._event()
        self._intervals.add("h2d", label, start, ready, _nbytes(pairs))
        return ready

    def wait(self, handle: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(handle)

    def release(self, slot: int) -> None:
        self._slot_free[slot] = self._event()

    def store(self, dev: torch.Tensor, host: torch.Tensor, scalar: torch.Tensor, label: str = "",
              ranges=None) -> "_EventDone":
        value = torch.empty((), dtype=scalar.dtype, pin_memory=True)
        pairs = _pieces(dev, host, ranges)
        return _EventDone(self._copy_out([*pairs, (scalar, value)], label, _nbytes(pairs)), value)

    def scalar(self, value: torch.Tensor) -> "_EventDone":
        """Start copying a device scalar to the host after the compute enqueued so far; the handle's
        ``result()`` is it as a float."""
        host = torch.empty((), dtype=value.dtype, pin_memory=True)
        return _EventDone(self._copy_out([(value, host)]), host)

    @contextlib.contextmanager
    def compute(self, label: str):
        start = self._event()
        yield
        self._intervals.add("compute", label, start, self._event(), 0)

    @contextlib.contextmanager
    def beside(self, after: torch.cuda.Event, tensors=()):
        """Make a stream of its own the calling thread's current one, after the compute stream's point
        ``after``: device work queued in the context runs beside the compute's (the copies stay on the
        copy streams). ``tensors`` [any], made on the compute stream, are read there: their memory is
        reused only once that stream is done with them."""
        with torch.cuda.stream(self.side):
            self.side.wait_event(after)
            for t in tensors:
                t.record_stream(self.side)
            tensors = t = None  # noqa: F841 (the caller frees each as it is done with it)
            yield

    def host_buffer(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def stash(self, dev: torch.Tensor, host: torch.Tensor, label: str = "") -> torch.cuda.Event:
        """Copy an activation out to a pinned host buffer on the copy-out stream, after the compute
        enqueued so far; the device tensor's memory is reused only once the copy is done."""
        return self._copy_out([(dev, host)], label)

    def _copy_out(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], label: str | None = None,
                  nbytes: int | None = None) -> torch.cuda.Event:
        """Copy each (device, host) pair on the copy-out stream after the compute enqueued so far;
        device memory is reused only once its copy is done. Returns the (host-waitable) done event;
        the span (none without a ``label``) counts ``nbytes`` (None: the first pair's bytes)."""
        computed = self._event()
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(computed)
            start = self._event()
            for dev, host in pairs:
                host.copy_(dev, non_blocking=True)
                dev.record_stream(self.d2h)
            done = self._event(blocking=True)
        if label is not None:
            self._intervals.add("d2h", label, start, done, _nbytes(pairs[:1]) if nbytes is None else nbytes)
        return done

    def unstash(self, host: torch.Tensor, done: torch.cuda.Event, label: str = "", into: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A device copy of a stashed activation, started on the copy-in stream once its copy-out
        (``done``) is complete; :meth:`wait` on the returned event before using the tensor. ``into``: a
        device tensor of the host's shape and dtype to copy into (the caller's own buffer, whose last
        reader ``done`` follows) instead of new memory."""
        dev = torch.empty(host.shape, dtype=host.dtype, device=self.device) if into is None else into
        allocated = self._event()  # the new memory's previous user on the compute stream is done
        with torch.cuda.stream(self.h2d):
            self.h2d.wait_event(allocated)
            self.h2d.wait_event(done)
            start = self._event()
            dev.copy_(host, non_blocking=True)
            ready = self._event()
        self._intervals.add("h2d", label, start, ready, host.numel() * host.element_size())
        return dev, ready

    def mark(self) -> torch.cuda.Event:
        """A point in the compute stream that :meth:`host_wait` can wait for."""
        return self._event(blocking=True)

    def host_wait(self, mark: torch.cuda.Event) -> None:
        """Block this thread (sleeping, not spinning) until the device has reached ``mark``."""
        mark.synchronize()

    def note(self, lane: str, label: str, start: float, end: float) -> None:
        """Record a host-side span (e.g. the compute thread waiting for weights)."""
        self._intervals.add(lane, label, start, end, 0)

    def begin_step(self) -> None:
        pass

    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def alloc_retries(self) -> int:
        """Allocations so far that found the device full and waited for the caching allocator to free
        its cache (a whole-device synchronisation each): a sign of memory planned too tight."""
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def end_step(self) -> list[tuple]:
        """Wait for the device, then turn the step's event pairs into wall-clock intervals."""
        intervals = self._intervals.take()
        for stream in (torch.cuda.current_stream(self.device), self.h2d, self.d2h):
            with torch.cuda.stream(stream):
                self._event(blocking=True).synchronize()
        wall0, ev0 = self._origin

        def wall(t):
            return t if isinstance(t, float) else wall0 + ev0.elapsed_time(t) / 1e3
        return [(lane, label, wall(a), wall(b), nbytes) for lane, label, a, b, nbytes in intervals]

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.synchronize()
        for ptr in self._registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self._registered.clear()


class _EventDone:
    def __init__(self, event: torch.cuda.Event, value: torch.Tensor):
        self.event, self.value = event, value

    def result(self) -> float:
        self.event.synchronize()
        return float(self.value)


def make_backend(device: str, num_slots: int, slot_numel: int, dtype: torch.dtype):
    if device == "cuda":
        return CudaBackend(num_slots, slot_numel, dtype)
    return CpuBackend(num_slots, slot_numel, dtype)
