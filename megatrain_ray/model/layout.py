"""Flat-buffer layout of the model's units, shared by the host store and the compute templates.

Every unit (``embed``, ``layers.i``, ``head``) is one contiguous run of elements. Inside it the
matrices, always weight-decayed, come first and the 1-D parameters (norms, biases), decayed only
with ``optim.decay_norms_and_biases``, after them, so the optimizer sees two contiguous views per
unit. Each unit starts at a multiple of :data:`UNIT_ALIGN` elements, so its block is page-aligned
in every dtype of the store (fp32, bf16), which is what ``cudaHostRegister``-backed copies and
per-layer mappings want.

Each unit is also a :class:`Unit` record (its position in the store, name, kind and decoder layer),
so the rest of the code asks ``layout.embed`` or ``unit.kind`` instead of reading meaning into a
position; a kind of unit the model gains (a layer's experts, an adapter) is a new ``kind`` with its
``layer`` and ``part``, and the engine's schedule and policies take it from there.

A :class:`LayerTemplate` is the stateless view of one unit: given any flat tensor holding that
unit (a host block, a device slot), ``bind`` returns the parameter dict of views into it, with no
copy and nothing retained. The members of each of the model's projection groups
(:data:`~megatrain_ray.model.transformer.PROJECTION_GROUPS`: q/k/v, gate/up) are placed back to
back, so ``bind(fused=True)`` can also offer the group's concatenation, which the model then runs
as one GEMM, as one more view under the group's name (``self_attn.qkv_proj.weight``, ...); where
alignment padding separates them (odd shapes), none is offered and the model runs one GEMM each.
Likewise a sparse layer's routed experts (:func:`~megatrain_ray.model.moe.sparse_params`: every
expert's gate and up back to back, then every down) are offered stacked, as the [E, 2I, H] and
[E, H, I] views :attr:`~megatrain_ray.model.moe.Names.stacked` names, which the grouped expert GEMMs
read with no copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from .moe import MIXTRAL_NAMES, QWEN_NAMES
from .transformer import PROJECTION_GROUPS, unit_names, unit_params

UNIT_ALIGN = 4096
"""Elements; 4096 elements are a whole number of 4 KiB pages in any dtype of >= 1 byte."""
PARAM_ALIGN = 64
"""Elements; parameters inside a unit start at this alignment (256 B in fp32) for vector loads."""


EMBEDDING, DECODER_LAYER, HEAD = "embedding", "decoder_layer", "head"
"""The kinds of unit of a dense decoder: the token embedding, one decoder layer, the final norm with
the LM head. A model with other parts (mixture-of-experts layers, adapters) adds kinds of its own."""


@dataclass(frozen=True)
class Unit:
    """One unit of the model: one contiguous block of every array of the store."""

    index: int
    """Its block's position in the store's arrays (and in ``StoreLayout.units``/``templates``)."""
    name: str
    """Its name in the store and in checkpoints: embed, layers.i, head."""
    kind: str
    """:data:`EMBEDDING`, :data:`DECODER_LAYER` or :data:`HEAD` (or a kind a model adds)."""
    layer: int | None = None
    """The decoder layer it belongs to (0-based), or None for the embedding and the head."""
    part: str = ""
    """Which part of its layer it is, where a layer is split into several units (e.g. one routed
    expert); "" for a whole layer."""


def _unit_record(index: int, name: str) -> Unit:
    if name == "embed":
        return Unit(index, name, EMBEDDING)
    if name == "head":
        return Unit(index, name, HEAD)
    return Unit(index, name, DECODER_LAYER, int(name.split(".")[1]))


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for dim in shape:
        out *= dim
    return out


@dataclass(frozen=True)
class LayerTemplate:
    """Parameter names, shapes and offsets of one unit inside its flat buffer."""

    unit: str
    params: tuple[tuple[str, tuple[int, ...], int], ...]
    """(name, shape, offset in elements), decayed parameters first."""
    numel: int
    """Elements used by the unit (the last parameter's end)."""
    decay_numel: int
    """The first ``decay_numel`` elements are the matrices (always weight-decayed); the rest are the
    norms and biases (decayed only with ``optim.decay_norms_and_biases``)."""
    fused: tuple[tuple[str, tuple[int, ...], int], ...] = ()
    """(name, shape, offset) of the projection groups' concatenated views (see the module docstring)."""

    @classmethod
    def build(cls, cfg: ModelConfig, unit: str) -> "LayerTemplate":
        return cls.of(unit, unit_params(cfg, unit))

    @classmethod
    def of(cls, unit: str, entries: list[tuple[str, tuple[int, ...]]]) -> "LayerTemplate":
        """The template of a unit with these (name, shape) parameters (a model unit's, or its adapters')."""
        ordered = [e for e in entries if len(e[1]) >= 2] + [e for e in entries if len(e[1]) < 2]
        params, offset, decay_numel = [], 0, 0
        for name, shape in ordered:
            offset = _round_up(offset, PARAM_ALIGN)
            size = _prod(shape)
            params.append((name, shape, offset))
            offset += size
            if len(shape) >= 2:
                decay_numel = offset
        return cls(unit, tuple(params), offset, decay_numel, _fusable(params))

    @property
    def param_count(self) -> int:
        """Parameters of the unit (alignment padding excluded)."""
        return sum(_prod(shape) for _, shape, _ in self.params)

    def bind(self, flat: torch.Tensor, fused: bool = False) -> dict[str, torch.Tensor]:
        """flat: [>= numel] -> {name: view of its shape}; no copy. ``fused``: also the concatenated
        view of each projection group whose members lie back to back (see the module docstring)."""
        out = {}
        for name, shape, offset in self.params + (self.fused if fused else ()):
            out[name] = flat[offset:offset + _prod(shape)].view(shape)
        return out


def _fusable(params: list[tuple[str, tuple[int, ...], int]]) -> tuple:
    """The concatenated view of each projection group whose weights (and biases, if any) lie back to back."""
    where = {name: (shape, offset) for name, shape, offset in params}
    out = []
    for fused, members in PROJECTION_GROUPS.items():
        views = []
        for suffix in ("weight", "bias"):
            names = [f"{m}.{suffix}" for m in members]
            present = [n in where for n in names]
            if not any(present):
                continue
            if not all(present):
                break
            shapes = [where[n][0] for n in names]
            offsets = [where[n][1] for n in names]
            if any(offsets[j + 1] != offsets[j] + _prod(shapes[j]) for j in range(len(names) - 1)):
                break
            if any(sh[1:] != shapes[0][1:] for sh in shapes):
                break
            views.append((f"{fused}.{suffix}", (sum(sh[0] for sh in shapes), *shapes[0][1:]), offsets[0]))
        else:
            out += views
    return tuple(out) + _stackable(where)


def _stackable(where: dict[str, tuple[tuple[int, ...], int]]) -> tuple:
    """The routed experts' stacked views (:attr:`~megatrain_ray.model.moe.Names.stacked`), when every
    expert's gate, up and then every down lie back to back; () for a dense layer or odd shapes."""
    family = next((f for f in (QWEN_NAMES, MIXTRAL_NAMES) if f.router in where), None)
    if family is None:
        return ()
    n = 0
    while family.expert(n)[0] in where:
        n += 1
    names = [family.expert(e) for e in range(n)]
    gate_ups = [name for g, u, _ in names for name in (g, u)]
    downs = [d for _, _, d in names]
    out = []
    for members, stacked in zip((gate_ups, downs), family.stacked):
        shapes = [where[m][0] for m in members]
        offsets = [where[m][1] for m in members]
        if any(offsets[j + 1] != offsets[j] + _prod(shapes[j]) for j in range(len(members) - 1)):
            return ()
        rows = shapes[0][0] * (len(members) // n)  # gate and up: 2I rows per expert; down: H
        out.append((stacked, (n, rows, shapes[0][1]), offsets[0]))
    return tuple(out)


@dataclass(frozen=True)
class StoreLayout:
    """Where each unit lives in the store's flat per-kind arrays."""

    units: tuple[str, ...]
    templates: tuple[LayerTemplate, ...]
    offsets: tuple[int, ...]
    """Start of each unit, in elements, in every per-kind array."""
    total: int
    """Elements of every per-kind array (units padded to UNIT_ALIGN)."""
    records: tuple[Unit, ...] = ()
    """Every unit as a :class:`Unit`, in store order."""

    @classmethod
    def build(cls, cfg: ModelConfig) -> "StoreLayout":
        units = tuple(unit_names(cfg))
        templates = tuple(LayerTemplate.build(cfg, u) for u in units)
        offsets, pos = [], 0
        for t in templates:
            offsets.append(pos)
            pos += _round_up(t.numel, UNIT_ALIGN)
        return cls(units, templates, tuple(offsets), pos, tuple(_unit_record(i, u) for i, u in enumerate(units)))

    def index(self, unit: str) -> int:
        return self.units.index(unit)

    def of_kind(self, kind: str) -> tuple[Unit, ...]:
        """The units of one kind, in store order."""
        return tuple(u for u in self.records if u.kind == kind)

    @property
    def embed(self) -> Unit:
        """The token embedding's unit."""
        return self.of_kind(EMBEDDING)[0]

    @property
    def head(self) -> Unit:
        """The final norm and LM head's unit."""
        return self.of_kind(HEAD)[0]

    @property
    def layers(self) -> tuple[Unit, ...]:
        """The decoder layers' units, in forward order."""
        return self.of_kind(DECODER_LAYER)

    @property
    def max_layer_numel(self) -> int:
        """Elements of the largest decoder layer unit (0 without layers)."""
        return max((self.templates[u.index].numel for u in self.layers), default=0)

    def block(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """flat: [total] -> the unit's used elements [numel] (a view)."""
        return flat[self.offsets[i]:self.offsets[i] + self.templates[i].numel]

    @property
    def max_unit_numel(self) -> int:
        return max(t.numel for t in self.templates)

    @property
    def slot_numel(self) -> int:
        """Elements of a unit-sized slot that holds any unit, page-aligned."""
        return _round_up(self.max_unit_numel, UNIT_ALIGN)

    @property
    def num_params(self) -> int:
        return sum(t.param_count for t in self.templates)
