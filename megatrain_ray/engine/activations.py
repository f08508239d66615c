"""Where each layer's input, kept from the forward for the recompute in the backward, lives.

By default the inputs stay on the device: (layers + 1) x micro-batches x [B, S, H] in the compute
dtype, the one part of device memory that grows with the number of layers. With
``runtime.offload_activations`` each layer's inputs are copied to pinned host buffers (on the
copy-out stream, overlapping the next layer's forward) as soon as the forward has used them, and
copied back (on the copy-in stream) one layer ahead of the backward that recomputes from them, so
device memory holds the inputs of about two layers whatever the depth: what long contexts need.
The compute thread enqueues work far ahead of the device; memory that waits for a copy is only
reused once the copy has run, so with offloading the thread is held to at most :data:`LEAD` layers
ahead of the device, or device memory would fill with activations whose copies have not run yet.
The host buffers are allocated once, at the first step, and reused (torch's pinned allocator
rounds each up to a power of two bytes, so they may take up to twice the checkpoints' size).
"""

from __future__ import annotations

import collections

import torch

LEAD = 2
"""Layers the compute thread may run ahead of the device while activations are offloaded."""


class ActivationStore:
    """Layer inputs by unit index, on the device or offloaded through a compute backend."""

    def __init__(self, backend, offload: bool):
        self.backend = backend
        self.offload = offload
        self._kept: dict[int, list[torch.Tensor]] = {}
        self._stashed: dict[int, list[tuple[torch.Tensor, object]]] = {}
        self._fetched: dict[int, list[tuple[torch.Tensor, object]]] = {}
        self._host: dict[tuple[int, int], torch.Tensor] = {}
        self._marks: collections.deque = collections.deque()

    def clear(self) -> None:
        """Forget every layer's inputs (the host buffers stay for the next step)."""
        self._marks.clear()
        self._kept.clear()
        self._stashed.clear()
        self._fetched.clear()

    def put(self, unit: int, xs: list[torch.Tensor]) -> None:
        """xs: M x [B, S, H], the input of ``unit`` for every micro-batch, no longer needed by the forward."""
        if not self.offload:
            self._kept[unit] = xs
            return
        self._hold_back()
        entries = []
        for m, x in enumerate(xs):
            host = self._host.get((unit, m))
            if host is None or host.shape != x.shape or host.dtype != x.dtype:
                host = self._host[(unit, m)] = self.backend.host_buffer(x.shape, x.dtype)
            entries.append((host, self.backend.stash(x, host, f"inputs of unit {unit}")))
        self._stashed[unit] = entries

    def prefetch(self, unit: int) -> None:
        """Start bringing ``unit``'s inputs back to the device (no-op when kept there or absent)."""
        if self.offload and unit in self._stashed and unit not in self._fetched:
            self._fetched[unit] = [self.backend.unstash(host, done, f"inputs of unit {unit}")
                                   for host, done in self._stashed.pop(unit)]

    def take(self, unit: int) -> list[torch.Tensor]:
        """``unit``'s inputs on the device, ready for the compute stream; forgets them here."""
        if not self.offload:
            return self._kept.pop(unit)
        self._hold_back()
        self.prefetch(unit)
        out = []
        for x, ready in self._fetched.pop(unit):
            self.backend.wait(ready)
            out.append(x)
        return out

    def _hold_back(self) -> None:
        """Wait until the device has caught up to within LEAD layers of the compute thread."""
        self._marks.append(self.backend.mark())
        while len(self._marks) > LEAD:
            self.backend.host_wait(self._marks.popleft())
