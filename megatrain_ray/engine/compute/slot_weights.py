"""A streamed unit's weights as the compute worker reads them from its device slot, chosen once by
the store's format of the base (:func:`slot_weights`): the slot's first elements, as fetched
(:class:`AsFetched`), or a quantized base's records dequantized into a weight slot on the compute
stream (:class:`Dequantized`, :class:`~megatrain_ray.engine.store.quantized.DeviceDequant`); and
what a device slot holds (:func:`slot_shape`).
"""

from __future__ import annotations

import torch

from ..store.host_store import HostStore, largest_streamed
from ..store.quantized import DeviceDequant


def slot_shape(store: HostStore, dtype: torch.dtype) -> tuple[int, torch.dtype]:
    """(elements, dtype) of a device slot: the largest streamed unit in the compute ``dtype``, or for a
    quantized base, where fetches land as bytes, the largest unit's bytes (uint8)."""
    if store.base is None:
        return largest_streamed(store.layout, store.spec.resident), dtype
    return store.base.layout.largest(range(len(store.layout.units))), torch.uint8


class AsFetched:
    """The unit's weights are its slot's first elements, as the fetch left them."""

    def __init__(self, store: HostStore, backend):
        self.templates, self.slots = store.layout.templates, backend.slots

    def weights(self, slot: int, unit: int, ranges) -> torch.Tensor:
        """Unit ``unit``'s flat weights [numel] in device slot ``slot`` (``ranges``: those fetched)."""
        return self.slots[slot][:self.templates[unit].numel]


class Dequantized:
    """The unit's records dequantized from its byte slot into a weight slot, a compute span of its own."""

    def __init__(self, store: HostStore, backend, dtype: torch.dtype):
        self.names, self.backend = store.layout.units, backend
        self.dequant = DeviceDequant(store.base.layout, store.layout.templates, backend.slots, dtype)

    def weights(self, slot: int, unit: int, ranges) -> torch.Tensor:
        """Unit ``unit``'s flat weights [numel] in the compute dtype, from byte slot ``slot``, whose
        element ``ranges`` (None: all) were fetched (:meth:`DeviceDequant.weights`)."""
        with self.backend.compute(self.names[unit] + " dequant"):
            return self.dequant.weights(slot, unit, ranges)


def slot_weights(store: HostStore, backend, dtype: torch.dtype) -> AsFetched | Dequantized:
    """How the compute worker reads a streamed unit's weights: by the store's base format."""
    return AsFetched(store, backend) if store.base is None else Dequantized(store, backend, dtype)
