"""Byte layout of a quantized base in the store: each unit one page-aligned run of bytes, one record per parameter.

A LoRA run's frozen base may be stored quantized (lora.base_format ``nf4`` or ``int8``, the formats of
:mod:`megatrain_ray.model.quant`, or ``mxfp4``, :mod:`megatrain_ray.model.mxfp4`). Each parameter is quantized on its own, as bitsandbytes quantizes
each ``Linear`` weight, into a :class:`Record` of the unit's bytes; the records follow the
parameters' order in the unit's :class:`~megatrain_ray.model.layout.LayerTemplate`, so any element
range of the template that covers whole parameters (a sparse layer's parts do:
:class:`~megatrain_ray.model.layout.Part`) is one byte range of the quantized unit
(:meth:`QuantUnit.byte_ranges`), and a routed fetch moves only the routed experts' codes and
statistics.

What is quantized (:func:`quantized`): with nf4 and int8, the projection matrices of the decoder
layers (attention, the MLP, a mixture of experts' shared and routed experts); with mxfp4, the routed
experts' weights alone (each expert's gate, up and down projection of a sparse layer, in every
family), as gpt-oss's Hub checkpoints hold them, the attention, shared experts and dense MLPs raw. The rest stays in the compute dtype (``raw`` records): norms,
biases, the routers (the top-k choice is kept exact) and the embedding and LM head units, whose
bytes are then exactly the compute-dtype block (each raw record starts where the template's element
offset puts it), so a unit of raw records alone is read as its weights with no copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from .layout import PARAM_ALIGN, UNIT_ALIGN, StoreLayout, built_once
from .moe import EXPERT, part_of
from .mxfp4 import mxfp4_bytes
from .quant import int8_bytes, nf4_bytes

RAW, INT8, NF4, MXFP4 = "raw", "int8", "nf4", "mxfp4"
FORMATS = (INT8, NF4, MXFP4)
"""The quantized formats of a base (lora.base_format's values but ``compute``)."""
PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                         "w1", "w2", "w3"})
"""The modules whose weight a quantized base quantizes (Hugging Face names; w1..w3: Mixtral's experts')."""
PIECE_ALIGN = 16
"""Bytes; each array of a quantized record starts at this alignment (fp32 views, vector loads)."""


def quantized(unit: str, name: str, shape: tuple[int, ...], fmt: str = NF4) -> bool:
    """Whether a base in format ``fmt`` quantizes the parameter ``name`` of ``unit`` (see the module docstring)."""
    parts = name.split(".")
    if not (unit.startswith("layers.") and len(shape) == 2 and parts[-1] == "weight"):
        return False
    return part_of(name)[0] == EXPERT if fmt == MXFP4 else parts[-2] in PROJECTIONS


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


@dataclass(frozen=True)
class Record:
    """One parameter's bytes in its unit's quantized block."""

    name: str
    shape: tuple[int, ...]
    offset: int
    """Its element offset in the unit's template (where its weights go in a weight slot)."""
    fmt: str
    """:data:`RAW` (compute dtype), :data:`INT8`, :data:`NF4` or :data:`MXFP4`."""
    start: int
    """Its first byte in the unit's block."""
    pieces: tuple[tuple[int, int], ...]
    """(start, end) bytes of its arrays: raw: the values; int8: codes, row absmax (fp32); nf4: codes,
    absmax codes, absmax2 (fp32), offset (fp32); mxfp4: codes, scales (e8m0 bytes)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.pieces[-1][1]


def _pieces(fmt: str, shape: tuple[int, ...], start: int, itemsize: int) -> tuple[tuple[int, int], ...]:
    if fmt == RAW:
        sizes = [math.prod(shape) * itemsize]
    elif fmt == INT8:
        codes, rows = int8_bytes(shape)
        sizes = [codes, 4 * rows]
    elif fmt == MXFP4:
        sizes = list(mxfp4_bytes(shape))
    else:
        codes, blocks, stats = nf4_bytes(math.prod(shape))
        sizes = [codes, blocks, 4 * stats, 4]
    out, pos = [], start
    for size in sizes:
        pos = _round_up(pos, PIECE_ALIGN)
        out.append((pos, pos + size))
        pos += size
    return tuple(out)


@dataclass(frozen=True)
class QuantUnit:
    """One unit's records and bytes."""

    records: tuple[Record, ...]
    nbytes: int

    @property
    def raw(self) -> bool:
        """Whether every record is raw: the block is the unit's compute-dtype weights as they are."""
        return all(r.fmt == RAW for r in self.records)

    def covered(self, ranges) -> tuple[Record, ...]:
        """The records whose parameters lie in the element ``ranges`` ((start, end) of the template;
        None: all); a range that cuts a parameter is a ValueError."""
        if ranges is None:
            return self.records
        out = []
        for r in self.records:
            inside = [a <= r.offset and r.offset + r.numel <= b for a, b in ranges]
            if any(inside):
                out.append(r)
            elif any(a < r.offset + r.numel and r.offset < b for a, b in ranges):
                raise ValueError(f"the element range {ranges} cuts the quantized parameter {r.name}")
        return tuple(out)

    def byte_ranges(self, ranges) -> list[tuple[int, int]] | None:
        """The (start, end) bytes that hold the parameters of the element ``ranges`` (None: the whole
        block), merged where they touch (each record's alignment padding goes with it)."""
        if ranges is None:
            return None
        ends = {r.name: (self.records[j + 1].start if j + 1 < len(self.records) else self.nbytes)
                for j, r in enumerate(self.records)}
        out: list[list[int]] = []
        for r in self.covered(ranges):
            if out and out[-1][1] == r.start:
                out[-1][1] = ends[r.name]
            else:
                out.append([r.start, ends[r.name]])
        return [(a, b) for a, b in out]


@dataclass(frozen=True)
class QuantLayout:
    """Where each unit's bytes live in the quantized base's one byte array of the store."""

    fmt: str
    units: tuple[QuantUnit, ...]
    offsets: tuple[int, ...]
    """Each unit's first byte, a multiple of :data:`~megatrain_ray.model.layout.UNIT_ALIGN`."""
    total: int

    @classmethod
    def build(cls, cfg: ModelConfig, fmt: str, dtype: torch.dtype) -> "QuantLayout":
        """The layout of ``cfg``'s base in format ``fmt`` (:data:`FORMATS`), raw parameters in ``dtype``
        (built once per config, :func:`~megatrain_ray.model.layout.built_once`)."""
        if fmt not in FORMATS:
            raise ValueError(f"a quantized base's format is one of {', '.join(FORMATS)}, got {fmt!r}")
        return built_once(("quant", repr(cfg), fmt, str(dtype)), lambda: cls._build(cfg, fmt, dtype))

    @classmethod
    def _build(cls, cfg: ModelConfig, fmt: str, dtype: torch.dtype) -> "QuantLayout":
        layout, itemsize = StoreLayout.build(cfg), dtype.itemsize
        units, offsets, total = [], [], 0
        for unit, template in zip(layout.units, layout.templates):
            records, pos = [], 0
            for name, shape, offset in sorted(template.params, key=lambda p: p[2]):
                kind = fmt if quantized(unit, name, shape, fmt) else RAW
                pos = _round_up(pos, PARAM_ALIGN * itemsize)
                pieces = _pieces(kind, shape, pos, itemsize)
                records.append(Record(name, shape, offset, kind, pos, pieces))
                pos = pieces[-1][1]
            q = QuantUnit(tuple(records), pos)
            if q.raw:
                assert all(r.start == r.offset * itemsize for r in records)
            units.append(q)
            offsets.append(total)
            total += _round_up(max(pos, 1), UNIT_ALIGN)
        return cls(fmt, tuple(units), tuple(offsets), total)

    def block(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """flat: [total] uint8 -> unit i's bytes [nbytes] (a view)."""
        return flat[self.offsets[i]:self.offsets[i] + self.units[i].nbytes]

    def largest(self, units) -> int:
        """Bytes of the largest of ``units`` (indices): what a device byte slot holds."""
        return max((self.units[i].nbytes for i in units), default=1)


def bytes_per_param(cfg: ModelConfig, fmt: str, dtype: torch.dtype) -> tuple[float, float]:
    """(bytes per parameter of the quantized decoder layers, of the whole base) of ``cfg`` in ``fmt``:
    the first counts the layers alone, the second the embedding and LM head too (raw)."""
    layout, q = StoreLayout.build(cfg), QuantLayout.build(cfg, fmt, dtype)
    layers = [u.index for u in layout.layers]
    params = sum(layout.templates[i].param_count for i in layers)
    return (sum(q.units[i].nbytes for i in layers) / max(params, 1), q.total / max(layout.num_params, 1))
