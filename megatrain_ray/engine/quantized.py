"""A quantized frozen base: its bytes in the host store, and its dequantization into the device weight slots.

With lora.base_format ``nf4`` or ``int8`` the store's ``master`` array of a LoRA run is the base's
bytes in the :class:`~megatrain_ray.model.quant_layout.QuantLayout` (each projection matrix
quantized on its own, the rest raw in the compute dtype), and the weights never exist on the host
in the compute dtype, except transiently, one tensor at a time:

- **loading** (:meth:`QuantizedBase.write`): each parameter, as it is read from an HF checkpoint or
  drawn at random, is quantized once into its record (through bitsandbytes where it is importable,
  else by :mod:`megatrain_ray.model.quant`'s torch code, bit-identical to it);
- **streaming**: the prefetcher's fetch of a unit moves its bytes (:meth:`QuantizedBase.fetch`: a
  sparse layer's routed fetch, the bytes of the routed parts' records alone) into a device *byte
  slot*; the compute worker then dequantizes them (:class:`DeviceDequant`) on its compute stream
  into the slot's *weight slot*, in the compute dtype and the template's element layout, which the
  layer's pass binds as it binds a streamed unit's slot: the model never sees the format;
- **reading** (:meth:`QuantizedBase.params`): dequantized copies, for the merged export (the
  adapters merged into the dequantized base, as peft merges into a bitsandbytes base) and tools.

A unit of raw records alone (the embedding, the head) is its compute-dtype block byte for byte, so
its weights are a view of the byte slot, with no copy.
"""

from __future__ import annotations

import torch

from ..model.layout import StoreLayout
from ..model.quant import dequantize_int8, dequantize_nf4, quantize_int8, quantize_nf4
from ..model.quant_layout import INT8, NF4, RAW, QuantLayout, QuantUnit, Record


def _piece(block: torch.Tensor, piece: tuple[int, int], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """block: [nbytes] uint8 -> the bytes of ``piece`` as a flat tensor of ``dtype`` (a view)."""
    return block[piece[0]:piece[1]].view(dtype)


def dequantize(record: Record, block: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """block: a unit's bytes [nbytes] uint8 (host or device) -> ``out`` [numel] (the compute dtype, on
    the block's device) filled with ``record``'s weights."""
    p = record.pieces
    if record.fmt == NF4:
        return dequantize_nf4(_piece(block, p[0]), _piece(block, p[1]), _piece(block, p[2], torch.float32),
                              _piece(block, p[3], torch.float32), out)
    if record.fmt == INT8:
        return dequantize_int8(_piece(block, p[0], torch.int8), _piece(block, p[1], torch.float32), out)
    return out.copy_(_piece(block, p[0], out.dtype))


class QuantizedBase:
    """The host side of a quantized base (see the module docstring): the store's ``master`` array of bytes."""

    def __init__(self, model, fmt: str, dtype: torch.dtype, array: torch.Tensor):
        """model: the ModelConfig; fmt: int8 or nf4; dtype: the compute dtype; array: [total] uint8."""
        self.layout = QuantLayout.build(model, fmt, dtype)
        self.templates = StoreLayout.build(model).templates
        self.dtype, self.array = dtype, array

    def block(self, i: int) -> torch.Tensor:
        """Unit i's bytes [nbytes] uint8 (a view of the store)."""
        return self.layout.block(self.array, i)

    def weights(self, i: int) -> torch.Tensor:
        """Unit i's flat weights [numel] in the compute dtype: a view of its bytes for a raw unit (the
        embedding, the head); a ValueError for a unit with quantized records."""
        if not self.layout.units[i].raw:
            raise ValueError(f"unit {i} of a quantized base has no compute-dtype block; read it through params()")
        return self.block(i).view(self.dtype)[:self.templates[i].numel]

    def fetch(self, i: int, ranges) -> tuple[torch.Tensor, list[tuple[int, int]] | None]:
        """(the host bytes of unit i, the byte ranges to copy) for a fetch of its element ``ranges``
        (None: whole)."""
        return self.block(i), self.layout.units[i].byte_ranges(ranges)

    def _record(self, i: int, name: str) -> Record:
        return next(r for r in self.layout.units[i].records if r.name == name)

    def write(self, i: int, name: str, value: torch.Tensor) -> None:
        """Quantize ``value`` (the parameter ``name`` of unit i, any float dtype) into its record: cast to
        the compute dtype first (the weights the unquantized base would hold), quantized from those."""
        record, block = self._record(i, name), self.block(i)
        value = value.detach().to(self.dtype).reshape(record.shape)
        p = record.pieces
        if record.fmt == RAW:
            _piece(block, p[0], self.dtype).copy_(value.reshape(-1))
        elif record.fmt == NF4:
            for piece, array in zip(p, quantize_nf4(value)):
                _piece(block, piece).copy_(array.contiguous().view(torch.uint8))
        else:
            codes, stats = quantize_int8(value)
            _piece(block, p[0], torch.int8).copy_(codes)
            _piece(block, p[1], torch.float32).copy_(stats)

    def params(self, i: int) -> dict[str, torch.Tensor]:
        """Unit i's parameters dequantized into the compute dtype (copies; writes go through :meth:`write`)."""
        block = self.block(i)
        return {r.name: dequantize(r, block, torch.empty(r.numel, dtype=self.dtype)).view(r.shape)
                for r in self.layout.units[i].records}


class DeviceDequant:
    """The compute worker's weight slots of a quantized base, one per device byte slot (see the module docstring)."""

    def __init__(self, layout: QuantLayout, templates, byte_slots: list[torch.Tensor], dtype: torch.dtype):
        """byte_slots: the backend's slots [>= largest unit's bytes] uint8, where fetches land; each gets a
        weight slot of the largest unit with quantized records (a raw unit is read in its byte slot)."""
        self.layout, self.templates, self.byte_slots, self.dtype = layout, templates, byte_slots, dtype
        numel = max((t.numel for t, u in zip(templates, layout.units) if not u.raw), default=1)
        self.weight_slots = [torch.empty(numel, dtype=dtype, device=s.device) for s in byte_slots]

    def weights(self, slot: int, i: int, ranges) -> torch.Tensor:
        """Unit i's weights [numel] from byte slot ``slot``, whose element ``ranges`` (None: all) were
        fetched: a view for a raw unit, else those ranges' parameters dequantized into the slot's weight
        slot on the current stream (the rest of it holds stale values that the pass does not read)."""
        unit: QuantUnit = self.layout.units[i]
        numel, block = self.templates[i].numel, self.byte_slots[slot][:unit.nbytes]
        if unit.raw:
            return block.view(self.dtype)[:numel]
        out = self.weight_slots[slot]
        for r in unit.covered(ranges):
            dequantize(r, block, out[r.offset:r.offset + r.numel])
        return out[:numel]
