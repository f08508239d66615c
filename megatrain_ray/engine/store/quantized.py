"""A quantized frozen base: its bytes in the host store, and its dequantization into the device weight slots.

With lora.base_format ``nf4``, ``int8`` or ``mxfp4`` the store's ``master`` array of a LoRA run is
the base's bytes in the :class:`~megatrain_ray.model.quant_layout.QuantLayout` (each quantized
matrix on its own: every projection matrix with nf4 and int8, the routed experts' with mxfp4; the
rest raw in the compute dtype), and the weights never exist on the host in the compute dtype,
except transiently, one tensor at a time:

- **loading** (:meth:`QuantizedBase.write`): each parameter, as it is read from an HF checkpoint or
  drawn at random, is quantized once into its record (nf4 and int8 by
  :mod:`megatrain_ray.model.quant`'s torch code, bit-identical to bitsandbytes'; mxfp4 by
  :mod:`megatrain_ray.model.mxfp4`'s); a checkpoint that holds a weight already in the record's
  format (a bitsandbytes nf4 checkpoint, gpt-oss's MXFP4 experts) gives its arrays as they are
  (:meth:`QuantizedBase.write_pieces`);
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

import dataclasses

import torch

from ...model.layout import StoreLayout
from ...model.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from ...model.quant import dequantize_int8, dequantize_nf4, quantize_int8, quantize_nf4
from ...model.quant_layout import INT8, MXFP4, NF4, RAW, QuantLayout, QuantUnit, Record


def _piece(block: torch.Tensor, piece: tuple[int, int], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """block: [nbytes] uint8 -> the bytes of ``piece`` as a flat tensor of ``dtype`` (a view)."""
    return block[piece[0]:piece[1]].view(dtype)


def runs(records) -> list[tuple[Record, ...]]:
    """``records`` (in block order) cut into runs of one format and shape lying at one byte stride and one
    element stride (a sparse layer's experts: each projection's run of E records), each dequantized by
    one set of kernels (:func:`dequantize_run`); a raw record is a run of its own."""
    out: list[list[Record]] = []
    for r in records:
        last = out[-1] if out else None
        if (last and r.fmt != RAW and last[0].fmt == r.fmt and last[0].shape == r.shape
                and (len(last) == 1 or (r.start - last[-1].start == last[1].start - last[0].start
                                        and r.offset - last[-1].offset == last[1].offset - last[0].offset))):
            last.append(r)
        else:
            out.append([r])
    return [tuple(run) for run in out]


def _rows(flat: torch.Tensor, run: tuple[Record, ...], piece: int, dtype: torch.dtype, size: int | None = None
          ) -> torch.Tensor:
    """[len(run), elements] view of array ``piece`` of each record of ``run`` in the bytes ``flat`` (as ``dtype``)."""
    itemsize = dtype.itemsize
    first = run[0].pieces[piece]
    stride = (run[1].start - run[0].start) // itemsize if len(run) > 1 else 0
    typed = flat[:flat.numel() // itemsize * itemsize].view(dtype)  # every piece of ``dtype`` ends within
    return typed.as_strided((len(run), (first[1] - first[0]) // itemsize if size is None else size),
                            (stride, 1), typed.storage_offset() + first[0] // itemsize)


def dequantize_run(run: tuple[Record, ...], block: torch.Tensor, out: torch.Tensor) -> None:
    """block: a unit's bytes [nbytes] uint8 (host or device); out: its weights [numel] in the compute
    dtype (a weight slot): each record's weights of ``run`` (:func:`runs`) dequantized into its place."""
    first = run[0]
    k, n = len(run), first.numel
    dst = out.as_strided((k, n), ((run[1].offset - first.offset) if k > 1 else 0, 1), out.storage_offset() + first.offset)
    if first.fmt == NF4:
        dequantize_nf4(_rows(block, run, 0, torch.uint8), _rows(block, run, 1, torch.uint8),
                       _rows(block, run, 2, torch.float32), _rows(block, run, 3, torch.float32), dst)
    elif first.fmt == INT8:
        dequantize_int8(_rows(block, run, 0, torch.int8), _rows(block, run, 1, torch.float32), dst)
    elif first.fmt == MXFP4:
        dequantize_mxfp4(_rows(block, run, 0, torch.uint8), _rows(block, run, 1, torch.uint8), dst)
    else:
        dst.copy_(_rows(block, run, 0, out.dtype))


def dequantize(record: Record, block: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """block: a unit's bytes [nbytes] uint8 -> ``out`` [numel] (the compute dtype, on the block's device)
    filled with ``record``'s weights."""
    dequantize_run((dataclasses.replace(record, offset=0),), block, out)
    return out


class QuantizedBase:
    """The host side of a quantized base (see the module docstring): the store's ``master`` array of bytes."""

    def __init__(self, model, fmt: str, dtype: torch.dtype, array: torch.Tensor):
        """model: the ModelConfig; fmt: int8, nf4 or mxfp4; dtype: the compute dtype; array: [total] uint8."""
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

    def record(self, i: int, name: str) -> Record:
        """The record of unit i's parameter ``name``."""
        return next(r for r in self.layout.units[i].records if r.name == name)

    def write_pieces(self, i: int, name: str, arrays) -> None:
        """Set the quantized record of unit i's ``name`` to ``arrays`` as its format's quantizer returns
        them: nf4's (codes, absmax codes, absmax2, offset) of :func:`~megatrain_ray.model.quant.quantize_nf4`,
        mxfp4's (codes, scales) of :func:`~megatrain_ray.model.mxfp4.quantize_mxfp4`; each array's
        bytes must fill its piece."""
        block, record = self.block(i), self.record(i, name)
        if record.fmt not in (NF4, MXFP4) or len(arrays) != len(record.pieces):
            raise ValueError(f"{name} of unit {i} is a {record.fmt} record of {len(record.pieces)} arrays")
        for piece, array in zip(record.pieces, arrays):
            _piece(block, piece).copy_(array.contiguous().reshape(-1).view(torch.uint8))

    def write(self, i: int, name: str, value: torch.Tensor) -> None:
        """Quantize ``value`` (the parameter ``name`` of unit i, any float dtype) into its record: cast to
        the compute dtype first (the weights the unquantized base would hold), quantized from those."""
        record, block = self.record(i, name), self.block(i)
        value = value.detach().to(self.dtype).reshape(record.shape)
        p = record.pieces
        if record.fmt == RAW:
            _piece(block, p[0], self.dtype).copy_(value.reshape(-1))
        elif record.fmt == NF4:
            self.write_pieces(i, name, quantize_nf4(value))
        elif record.fmt == MXFP4:
            self.write_pieces(i, name, quantize_mxfp4(value))
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
        self._runs: dict[tuple, list[tuple[Record, ...]]] = {}
        """The runs (:func:`runs`) of each (unit, fetched ranges) seen: a routed fetch's depend on its experts."""

    def weights(self, slot: int, i: int, ranges) -> torch.Tensor:
        """Unit i's weights [numel] from byte slot ``slot``, whose element ``ranges`` (None: all) were
        fetched: a view for a raw unit, else those ranges' parameters dequantized into the slot's weight
        slot on the current stream (the rest of it holds stale values that the pass does not read)."""
        unit: QuantUnit = self.layout.units[i]
        numel, block = self.templates[i].numel, self.byte_slots[slot][:unit.nbytes]
        if unit.raw:
            return block.view(self.dtype)[:numel]
        out = self.weight_slots[slot]
        key = (i, None if ranges is None else tuple(ranges))
        if key not in self._runs:
            self._runs[key] = runs(unit.covered(ranges))
        for run in self._runs[key]:
            dequantize_run(run, block, out)
        return out[:numel]
