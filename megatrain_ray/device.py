"""The device-specific part of the compute worker, behind one small interface.

A backend owns the device weight slots and the two copy directions:

- ``load(slot, host_block)``: start copying a unit's streamed weights into a slot; returns a
  handle that ``wait`` turns into "the compute may read the slot now";
- ``release(slot)``: the compute is done reading the slot (a later load may overwrite it);
- ``store(dev, host_block, scalar)``: start copying a device tensor (a gradient) to the host,
  with a device scalar (its squared norm); returns a handle whose ``result()`` blocks until the
  host bytes are complete and returns the scalar as a float.

:class:`CpuBackend` does plain synchronous copies. :class:`CudaBackend` registers the host store's
shared memory as pinned memory once (``cudaHostRegister``) and runs H2D and D2H on their own
streams, ordered against the compute stream with events, so the host never synchronises in the
steady state except where a gradient must be complete before its ticket is sent.
"""

from __future__ import annotations

import torch


class CpuBackend:
    """Slots in ordinary memory; every copy completes before it returns."""

    name = "cpu"

    def __init__(self, num_slots: int, slot_numel: int, dtype: torch.dtype):
        self.device = torch.device("cpu")
        self.slots = [torch.empty(slot_numel, dtype=dtype) for _ in range(num_slots)]

    def register_host(self, tensor: torch.Tensor) -> None:
        """Nothing to pin on the CPU."""

    def load(self, slot: int, host: torch.Tensor) -> None:
        self.slots[slot][:host.numel()].copy_(host)

    def wait(self, handle: None) -> None:
        pass

    def release(self, slot: int) -> None:
        pass

    def store(self, dev: torch.Tensor, host: torch.Tensor, scalar: torch.Tensor) -> "_Done":
        host.copy_(dev)
        return _Done(float(scalar))

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass


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
        self._slot_free = [None] * num_slots
        self._registered: list[int] = []

    def register_host(self, tensor: torch.Tensor) -> None:
        """Pin a shared-memory mapping once so copies from/to it run at full link speed."""
        if tensor.numel() == 0:
            return
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)}")
        self._registered.append(ptr)

    def load(self, slot: int, host: torch.Tensor) -> torch.cuda.Event:
        with torch.cuda.stream(self.h2d):
            if self._slot_free[slot] is not None:
                self.h2d.wait_event(self._slot_free[slot])
            self.slots[slot][:host.numel()].copy_(host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.h2d)
        return ready

    def wait(self, handle: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(handle)

    def release(self, slot: int) -> None:
        free = torch.cuda.Event()
        free.record(torch.cuda.current_stream(self.device))
        self._slot_free[slot] = free

    def store(self, dev: torch.Tensor, host: torch.Tensor, scalar: torch.Tensor) -> "_EventDone":
        computed = torch.cuda.Event()
        computed.record(torch.cuda.current_stream(self.device))
        value = torch.empty((), dtype=scalar.dtype, pin_memory=True)
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(computed)
            host.copy_(dev, non_blocking=True)
            value.copy_(scalar, non_blocking=True)
            dev.record_stream(self.d2h)
            scalar.record_stream(self.d2h)
            done = torch.cuda.Event()
            done.record(self.d2h)
        return _EventDone(done, value)

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
