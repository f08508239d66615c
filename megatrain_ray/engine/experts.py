"""A mixture of experts' routed experts on the link: which parts of a sparse layer cross, and when.

A sparse layer is one unit of the store with parts (:class:`~megatrain_ray.model.layout.Part`: its
attention with router and norms, its shared expert, each routed expert), each a few element ranges
of the unit's block. What crosses the link follows the step's routing, which the compute worker
knows once its forward has run the layer:

- **forward**: the whole block, in one copy, like a dense unit of the same bytes (the routing is
  not known yet, and waiting for it would stall the GPU);
- **later fetches of the step** (its backward, a recompute span's forward again: the same inputs,
  so the same routing): only the parts the routing uses, i.e. all but the routed experts that no
  token of this worker chose, as the fewest contiguous copies (:meth:`~megatrain_ray.model.layout.Unit.ranges`:
  the experts' gate/up weights lie back to back, then their down weights, so k consecutive routed
  experts are two copies, and all experts routed is the whole block, one copy). The slot's ranges of
  the other experts hold stale bytes, which nothing reads: an expert without a token has zero rows
  in the grouped GEMMs, so zero gradient whatever its weights (:func:`~megatrain_ray.model.moe.routed_experts`);
  the recompute is given the forward's choice (:class:`~megatrain_ray.engine.compute.routing.StepRouting`),
  so it uses exactly the experts that came;
- **gradient**: with the unit's policy ``experts: routed`` (:mod:`megatrain_ray.engine.policy`), only
  the same parts' ranges go to the host; the ticket names the parts left out
  (:attr:`~megatrain_ray.engine.tickets.GradTicket.skipped`), whose gradient is exactly zero, and the
  sink zeroes their ranges of the host gradient block (:func:`zero_skipped`) before the unit's update,
  which then is that of a zero gradient: the moments decay and the weight decays, as
  torch.optim.AdamW does with it. With ``experts: all`` (data-parallel workers, each seeing its share
  of the routing) every expert's gradient crosses.

:class:`ExpertTraffic` is the compute worker's record of it: the routing of each sparse layer as the
forward finds it (a copy of its [E] counts to the host, which the loader thread waits for), the
ranges of each fetch and gradient, and per step and sparse layer, the fetches after the routing
and the gradient bytes of each expert (``expert_refetches``, ``expert_grad_bytes`` in the step's
result and metrics.jsonl).
"""

from __future__ import annotations

import threading

import torch

from ..model.layout import Unit
from ..model.moe import EXPERT
from .policy import ROUTED


def overlap(ranges, other) -> int:
    """Elements that two lists of (start, end) ranges share (None as ``other``: all of ``ranges``)."""
    if other is None:
        return sum(b - a for a, b in ranges)
    return sum(max(0, min(b, d) - max(a, c)) for a, b in ranges for c, d in other)


def zero_skipped(block: torch.Tensor, unit: Unit, skipped: tuple[int, ...]) -> None:
    """Zero the ranges of ``unit``'s parts ``skipped`` (indices into ``unit.parts``) in its gradient
    ``block`` [numel]: the gradient they have, which did not cross the link."""
    for j in skipped:
        for a, b in unit.parts[j].ranges:
            block[a:b].zero_()


class ExpertTraffic:
    """The compute worker's record of its sparse layers' routing and traffic (see the module docstring)."""

    def __init__(self, layout, backend, stop: threading.Event):
        self.records = layout.records
        self.sparse = [u for u in layout.layers if u.parts]
        self.unit_of = {u.layer: u.index for u in self.sparse}
        """Each sparse decoder layer's unit."""
        self.backend = backend
        self.stop = stop
        self._cond = threading.Condition()
        self._step = -1
        self._routing: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, object]] = {}
        """(step, unit): (the forward's counts [E] on the device, held while their copy to the host runs; that copy; its mark)."""
        self._refetches: dict[tuple[int, int], list[int]] = {}
        self._grad_bytes: dict[tuple[int, int], list[int]] = {}

    # -- the compute thread --------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        """Step ``step`` starts: a loader still waiting for an earlier step's routing fetches whole."""
        with self._cond:
            self._step = step
            for key in [k for k in self._routing if k[0] < step]:
                del self._routing[key]
            self._cond.notify_all()

    def record(self, step: int, layer: int, counts: torch.Tensor) -> None:
        """The forward's routing through sparse decoder layer ``layer``: counts [E], tokens per expert (device)."""
        unit = self.unit_of[layer]
        host = self.backend.host_buffer(counts.shape, counts.dtype)
        host.copy_(counts, non_blocking=True)
        with self._cond:
            self._routing[(step, unit)] = (counts, host, self.backend.mark())
            self._cond.notify_all()

    def report(self, step: int) -> dict:
        """The step's ``expert_refetches`` and ``expert_grad_bytes`` (per sparse layer, per expert)."""
        with self._cond:
            refetches = [self._refetches.pop((step, u.index), [0] * len(u.experts)) for u in self.sparse]
            grad_bytes = [self._grad_bytes.pop((step, u.index), [0] * len(u.experts)) for u in self.sparse]
        return {"expert_refetches": refetches, "expert_grad_bytes": grad_bytes} if self.sparse else {}

    # -- the loader thread ---------------------------------------------------------------------

    def fetch_ranges(self, unit: int, step: int, refetch: bool) -> list[tuple[int, int]] | None:
        """The ranges of ``unit``'s block a fetch copies: None (whole) for a unit without parts or its
        first fetch of the step, else those of the parts the step's routing uses (waits for it)."""
        record = self.records[unit]
        if not record.parts or not refetch:
            return None
        used = self._used(unit, step)
        ranges = None if used is None else record.ranges(used)
        with self._cond:
            counts = self._refetches.setdefault((step, unit), [0] * len(record.experts))
            for e, part in enumerate(record.experts):
                counts[e] += overlap(part.ranges, ranges) > 0
        return ranges

    def _used(self, unit: int, step: int):
        """The parts of ``unit`` that step ``step``'s routing uses (waits for the forward to find it),
        or None when that step is over or the worker is stopping (then the fetch is whole)."""
        with self._cond:
            while (step, unit) not in self._routing:
                if self.stop.is_set() or self._step > step:
                    return None
                self._cond.wait(0.2)
            _, host, mark = self._routing[(step, unit)]
        self.backend.host_wait(mark)
        chosen = host.tolist()
        return [p for p in self.records[unit].parts if p.kind != EXPERT or chosen[p.expert] > 0]

    # -- the gradient path ---------------------------------------------------------------------

    def grad_ranges(self, unit: int, step: int, policy, itemsize: int
                    ) -> tuple[list[tuple[int, int]] | None, tuple[int, ...]]:
        """(the ranges of ``unit``'s gradient that go to the host, None: all; the indices of its parts
        left out) under its ``policy``; counts each expert's bytes (``itemsize`` per element)."""
        record = self.records[unit]
        if not record.parts:
            return None, ()
        ranges, skipped = None, ()
        used = self._used(unit, step) if policy.experts == ROUTED else None
        if used is not None:
            ranges = record.ranges(used)
            skipped = tuple(j for j, p in enumerate(record.parts) if p not in used)
        with self._cond:
            sent = self._grad_bytes.setdefault((step, unit), [0] * len(record.experts))
            for e, part in enumerate(record.experts):
                sent[e] += overlap(part.ranges, ranges) * itemsize
        return ranges, skipped
