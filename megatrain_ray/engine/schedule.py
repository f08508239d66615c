"""The order of a step's units, built once per run from the layout: which units are fetched and
when, in which order they are updated, and which role updates each.

A unit is named by its :class:`~megatrain_ray.model.layout.Unit` record's ``index`` in tickets and
in the store; everything that needs its meaning (the embedding, a decoder layer, the head) asks the
layout's records, never the index itself. A decoder layer's units are all those whose ``layer`` is
that layer (one for a dense layer; several where a model splits a layer, e.g. into experts), fetched
together in store order.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model.layout import StoreLayout

COMPUTE, SINK = "compute", "sink"
"""Who updates a unit: the compute worker (a unit resident on its device) or the gradient sink."""


@dataclass(frozen=True)
class Schedule:
    """The order of one step's units (indices into the layout's records)."""

    fetch: tuple[int, ...]
    """Units in the order one step streams their weights to the device: embedding, layers forward,
    head (with the embedding again when tied), layers backward. Every decoder layer appears exactly
    twice, whatever the number of micro-batches (a recompute span's layers but its last once more,
    in forward order, just before the span's backward); resident units never."""
    update: tuple[int, ...]
    """Every unit, in the order the next step's forward needs them: embedding, layers, head."""
    resident: tuple[int, ...] = ()
    """Units resident on the compute worker's device, updated there (see :mod:`megatrain_ray.engine.compute.resident`)."""
    refetch: tuple[bool, ...] = ()
    """For each entry of ``fetch``: whether it is a later fetch of its unit in the step (not the
    first), so that the step's routing through the unit is known by then (the forward has run it)
    and a sparse layer's fetch moves only the parts that routing uses (:mod:`megatrain_ray.engine.experts`)."""

    @classmethod
    def build(cls, layout: StoreLayout, tied: bool, resident: tuple[int, ...] = (),
              spans: tuple[tuple[int, int], ...] = ()) -> Schedule:
        """``spans``: (first, last) decoder layer of each recompute span
        (:func:`~megatrain_ray.engine.compute.activations.recompute_spans`)."""
        layers = sorted({u.layer for u in layout.layers})
        group = {i: [u.index for u in layout.records if u.layer == i] for i in layers}
        embed, head = layout.embed.index, layout.head.index
        forward = [embed, *(u for i in layers for u in group[i]), head, *([embed] if tied else [])]
        again = {last: range(first, last) for first, last in spans}  # layers run forward again before `last`
        backward = [u for i in reversed(layers) for j in (*again.get(i, ()), i) for u in group[j]]
        fetch = tuple(u for u in forward + backward if u not in resident)
        refetch = tuple(u in fetch[:k] for k, u in enumerate(fetch))
        return cls(fetch, tuple(u.index for u in layout.records), tuple(resident), refetch)

    def owner(self, unit: int) -> str:
        """:data:`COMPUTE` for a resident unit, else :data:`SINK`."""
        return COMPUTE if unit in self.resident else SINK

    @property
    def sink_updates(self) -> tuple[int, ...]:
        """The units the gradient sink updates, in update order."""
        return tuple(u for u in self.update if u not in self.resident)
