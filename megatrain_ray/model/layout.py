"""Flat-buffer layout of the model's units, shared by the host store and the compute templates.

Every unit (``embed``, ``layers.i``, ``head``) is one contiguous run of elements. Inside it the
matrices, always weight-decayed, come first and the 1-D parameters (norms, biases), decayed only
with ``optim.decay_norms_and_biases``, after them, so the optimizer sees two contiguous views per
unit. Each unit starts at a multiple of :data:`UNIT_ALIGN` elements, so its block is page-aligned
in every dtype of the store (fp32, bf16), which is what ``cudaHostRegister``-backed copies and
per-layer mappings want.

Each unit is also a :class:`Unit` record (its position in the store, name, kind and decoder layer),
so the rest of the code asks ``layout.embed`` or ``unit.kind`` instead of reading meaning into a
position; a kind of unit the model gains (an adapter) is a new ``kind`` with its ``layer`` and
``part``, and the engine's schedule and policies take it from there.

A sparse layer of a mixture of experts is one unit with *parts* (:class:`Part`): its attention with
the router and the norms, its shared expert (Qwen2-MoE) and each routed expert, each with its own
element ranges inside the unit's block (an expert's gate and up weights, and its down weight: two
ranges, since the stacked views below want every expert's gate/up back to back, then every down).
The parts' ranges tile the block (alignment padding goes with the parameter before it), so the
ranges of any set of parts merged where they touch (:meth:`Unit.ranges`) are the fewest contiguous
copies that move those parts, and the ranges of all parts are the whole block: one copy, as for a
dense unit. The engine streams a sparse layer whole for its forward, and for its backward, and
sends gradients back, only for the parts the step's routing used (:mod:`megatrain_ray.engine.experts`).

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

import threading
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from .moe import ATTENTION, EXPERT, FAMILIES, part_of
from .transformer import PROJECTION_GROUPS, unit_names, unit_params

UNIT_ALIGN = 4096
"""Elements; 4096 elements are a whole number of 4 KiB pages in any dtype of >= 1 byte."""
PARAM_ALIGN = 64
"""Elements; parameters inside a unit start at this alignment (256 B in fp32) for vector loads."""


EMBEDDING, DECODER_LAYER, HEAD = "embedding", "decoder_layer", "head"
"""The kinds of unit of a dense decoder: the token embedding, one decoder layer, the final norm with
the LM head. A model with other parts (mixture-of-experts layers, adapters) adds kinds of its own."""


@dataclass(frozen=True)
class Part:
    """One part of a unit that is split by what the step's routing uses (a sparse layer's)."""

    name: str
    """``attention`` (attention, router, norms, biases), ``shared_expert`` or ``experts.j``."""
    kind: str
    """:data:`~megatrain_ray.model.moe.ATTENTION`, ``SHARED_EXPERT`` or ``EXPERT``."""
    ranges: tuple[tuple[int, int], ...]
    """(start, end) element ranges inside the unit's block, ascending, padding included."""
    expert: int | None = None
    """The routed expert's index, for an ``experts.j`` part."""

    @property
    def numel(self) -> int:
        """Elements of its ranges."""
        return sum(b - a for a, b in self.ranges)


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
    """Which part of its layer it is, where a layer is split into several units; "" for a whole layer."""
    parts: tuple[Part, ...] = ()
    """Its parts by routing (a sparse layer's; see the module docstring), () for a unit used whole."""

    @property
    def experts(self) -> tuple[Part, ...]:
        """Its routed experts' parts, in expert order."""
        return tuple(p for p in self.parts if p.kind == EXPERT)

    def ranges(self, parts) -> list[tuple[int, int]]:
        """The (start, end) element ranges of ``parts`` (some of :attr:`parts`), merged where they touch:
        the fewest contiguous copies that move them."""
        out: list[list[int]] = []
        for a, b in sorted(r for p in parts for r in p.ranges):
            if out and out[-1][1] == a:
                out[-1][1] = b
            else:
                out.append([a, b])
        return [(a, b) for a, b in out]


_BUILT: dict[tuple, object] = {}
"""The layouts :func:`built_once` made, by their key (the oldest dropped first)."""
_BUILT_KEPT = 16
_BUILDING = threading.Lock()


def built_once(key: tuple, build):
    """``build()``, made once per ``key`` and shared: for immutable layouts (this module's, the adapters'
    and a quantized base's), which planning asks for hundreds of times per config; a mixture's have
    a record per expert per layer. ``key``: what the layout is of (its kind, the repr of its config)."""
    layout = _BUILT.get(key)
    if layout is None:
        layout = build()
        with _BUILDING:
            while len(_BUILT) >= _BUILT_KEPT:
                _BUILT.pop(next(iter(_BUILT)))
            _BUILT[key] = layout
    return layout


def _unit_record(index: int, name: str, template: LayerTemplate) -> Unit:
    if name == "embed":
        return Unit(index, name, EMBEDDING)
    if name == "head":
        return Unit(index, name, HEAD)
    return Unit(index, name, DECODER_LAYER, int(name.split(".")[1]), parts=_parts(template))


def _parts(template: LayerTemplate) -> tuple[Part, ...]:
    """A sparse layer's parts (see the module docstring), () for a dense one: each parameter's extent
    (its offset to the next parameter's, or to the unit's end) goes to its part."""
    by_offset = sorted(template.params, key=lambda e: e[2])
    owners = [part_of(name) for name, _, _ in by_offset]
    if not any(kind == EXPERT for kind, _ in owners):
        return ()
    ranges: dict[tuple[str, int | None], list[tuple[int, int]]] = {}
    for j, ((_, _, offset), owner) in enumerate(zip(by_offset, owners)):
        end = by_offset[j + 1][2] if j + 1 < len(by_offset) else template.numel
        spans = ranges.setdefault(owner, [])
        if spans and spans[-1][1] == offset:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((offset, end))
    order = sorted(ranges, key=lambda o: (o[0] != ATTENTION, o[0] == EXPERT, o[1] or 0))
    return tuple(Part(kind if e is None else f"experts.{e}", kind, tuple(ranges[(kind, e)]), e) for kind, e in order)


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
    family = next((f for f in FAMILIES if f.router in where), None)
    if family is None:
        return ()
    n = 0
    while family.expert(n)[0] in where:
        n += 1
    if n == 0:  # a router without experts: an adapter unit's router trained in full
        return ()
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
    return tuple(out) + (_stackable_biases(where, family, n) if family.biased else ())


def _stackable_biases(where: dict[str, tuple[tuple[int, ...], int]], family, n: int) -> tuple:
    """A biased family's stacked expert biases ([E, 2I], [E, H], under
    :attr:`~megatrain_ray.model.moe.Names.stacked_bias`), each where its members lie back to back."""
    names = [family.expert_bias(e) for e in range(n)]
    out = []
    for members, stacked in zip(([b for g, u, _ in names for b in (g, u)], [d for _, _, d in names]),
                                family.stacked_bias):
        shapes = [where[m][0] for m in members]
        offsets = [where[m][1] for m in members]
        if all(offsets[j + 1] == offsets[j] + shapes[j][0] for j in range(len(members) - 1)):
            out.append((stacked, (n, shapes[0][0] * (len(members) // n)), offsets[0]))
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
        """The layout of ``cfg`` (built once per config, :func:`built_once`)."""
        return built_once(("store", repr(cfg)), lambda: cls._build(cfg))

    @classmethod
    def _build(cls, cfg: ModelConfig) -> "StoreLayout":
        units = tuple(unit_names(cfg))
        templates = tuple(LayerTemplate.build(cfg, u) for u in units)
        offsets, pos = [], 0
        for t in templates:
            offsets.append(pos)
            pos += _round_up(t.numel, UNIT_ALIGN)
        return cls(units, templates, tuple(offsets), pos,
                   tuple(_unit_record(i, u, t) for i, (u, t) in enumerate(zip(units, templates))))

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
