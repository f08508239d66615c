"""A step's gradients as the gradient sink takes them: whole tickets, the step's norm, and the
clipping factor each unit's update gets (:mod:`megatrain_ray.engine.sink.gradient_sink`).

Tickets (:class:`StepTickets`): a unit's gradient is whole once every compute worker's ticket for
it is in, each for its shard of the all-reduced gradient (the step's squared norm sums each
ticket's, in the order they came); with experimental.grad_reduce=host (:class:`HostSums`) each
ticket is for a worker's whole gradient in a host copy of its own, summed here once the unit's last
is in (the step's squared norm then sums each summed gradient's).

The norm (a :class:`StepNorm`) decides when each unit's update may run, and with which factor:

- :class:`AsArrived`: no clipping (and no sharded optimizer), so no factor to wait for: each unit
  is updated the moment its gradient is whole; the norm is checked once the step's last is in;
- :class:`InUpdateOrder`: the factor needs the step's norm (clipping, or a sharded optimizer), so
  the updates run after the last gradient, in update order;
- :class:`Carried`: the gradients were held on the device until the norm was known
  (``StoreSpec.hold_grads``): each ticket carries the step's squared norm, so each unit is clipped
  and updated as it arrives (in update order, the order they were sent).

Either way the sink reads one loop: for each (ticket, factor) the norm gives, the unit's optimizer's
update.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from ...errors import PipelineError
from ..experts import zero_skipped
from ..grad_reduce import sum_copies
from ..policy import NONE, UnitPolicy
from ..tickets import GradTicket

Updates = Iterator[tuple[GradTicket, float]]
"""(the ticket of a unit to update now, its clipping factor)."""


class StepTickets:
    """The ticket of each unit of a step once its gradient is whole (every worker's ticket in), its
    skipped parts' gradient zeroed (a sparse layer's experts no token chose, :mod:`megatrain_ray.engine.experts`)."""

    def __init__(self, store, policies: tuple[UnitPolicy, ...], per_unit: int, get: Callable[[], GradTicket]):
        """policies: each unit's (those whose gradient is none send no ticket); per_unit: the tickets
        of each unit and step (one per compute worker of the node); get: the next ticket."""
        self.store, self.layout = store, store.layout
        self.expected = tuple(u for u, p in enumerate(policies) if p.gradient != NONE)
        self.per_unit, self.get = per_unit, get
        self.sq_norm = 0.0
        """The squared norm of the step's gradient, so far."""

    def __call__(self, step: int) -> Iterator[GradTicket]:
        self.sq_norm = 0.0
        pending = dict.fromkeys(self.expected, self.per_unit)
        while pending:
            ticket = self.get()
            if ticket.step != step or ticket.unit not in pending:
                raise PipelineError(f"unexpected gradient of {self.layout.units[ticket.unit]} for step "
                                    f"{ticket.step} while collecting step {step}.")
            self.sq_norm += self._part(ticket)
            pending[ticket.unit] -= 1
            if pending[ticket.unit]:
                continue  # other workers' shards of this unit are still on their way
            del pending[ticket.unit]
            self.sq_norm += self._whole(ticket)
            if ticket.skipped:  # a sparse layer's experts without a token: their zero gradient did not cross
                zero_skipped(self.store.grad_block(ticket.unit, ticket.slot), self.layout.records[ticket.unit],
                             ticket.skipped)
            yield ticket

    def _part(self, ticket: GradTicket) -> float:
        """What one worker's ticket adds to the step's squared norm: its shard's."""
        return ticket.sq_norm

    def _whole(self, ticket: GradTicket) -> float:
        """What a unit's whole gradient adds to it (its shards' are in)."""
        return 0.0

    def close(self) -> None:
        pass


class HostSums(StepTickets):
    """experimental.grad_reduce=host: each worker's ticket is for its whole gradient, in its own host
    copy; once a unit's last is in, the copies of a unit this sink updates are summed into its grad
    block (:func:`~megatrain_ray.engine.grad_reduce.sum_copies`), and the sum's squared norm counts."""

    def __init__(self, store, policies: tuple[UnitPolicy, ...], per_unit: int, get: Callable[[], GradTicket],
                 summed: tuple[int, ...], threads: int, note: Callable[[str, float, float], None]):
        """summed: the units whose copies are summed (this sink's); note(what, start, end): the sum's span."""
        super().__init__(store, policies, per_unit, get)
        self.summed, self.threads, self.note = set(summed), threads, note
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grad-sum")

    def _part(self, ticket: GradTicket) -> float:
        return 0.0

    def _whole(self, ticket: GradTicket) -> float:
        if ticket.unit not in self.summed:
            return 0.0
        start = time.time()
        copies = [self.store.grad_block(ticket.unit, -1, k) for k in range(self.per_unit)]
        sq_norm = sum_copies(copies, self._pool, self.threads)
        self.note(f"sum {self.layout.units[ticket.unit]}", start, time.time())
        return sq_norm

    def close(self) -> None:
        self._pool.shutdown()


class StepNorm:
    """When each unit of a step is updated, with which clipping factor (see the module docstring)."""

    def __init__(self, tickets: StepTickets, updated: tuple[int, ...], factor: Callable[[int, float], float]):
        """updated: the units this sink updates, in update order; factor(step, norm): the step's
        clipping factor (raises where the norm is not finite)."""
        self.tickets, self.updated, self.factor = tickets, updated, factor
        self._updated = set(updated)
        self.value = 0.0
        """The last step's gradient norm, once its updates have all been given."""

    def updates(self, step: int) -> Updates:
        raise NotImplementedError


class AsArrived(StepNorm):
    """No factor to wait for: each unit's update as its gradient comes, unscaled."""

    def updates(self, step: int) -> Updates:
        for ticket in self.tickets(step):
            if ticket.unit in self._updated:
                yield ticket, 1.0
        self.value = math.sqrt(self.tickets.sq_norm)
        self.factor(step, self.value)


class InUpdateOrder(StepNorm):
    """The factor of the step's norm: every update once the last gradient is in, in update order."""

    def updates(self, step: int) -> Updates:
        arrived = {ticket.unit: ticket for ticket in self.tickets(step) if ticket.unit in self._updated}
        self.value = math.sqrt(self.tickets.sq_norm)
        coef = self.factor(step, self.value)
        for unit in self.updated:
            if unit in arrived:
                yield arrived[unit], coef


class Carried(StepNorm):
    """Held gradients: each ticket carries the step's squared norm, so each unit's update as it comes.
    The tickets of the streamed units updated on the device went during the backward, before the norm
    was known: they carry none (a negative one), and no update here. Where no ticket carries one
    (every unit updated on the device), the step's norm sums the tickets' own."""

    def updates(self, step: int) -> Updates:
        step_sq_norm = -1.0
        for ticket in self.tickets(step):
            if ticket.step_sq_norm < 0:
                continue  # a unit updated on the device: its gradient is done, the norm not yet known
            step_sq_norm = ticket.step_sq_norm
            coef = self.factor(step, math.sqrt(step_sq_norm))
            if ticket.unit in self._updated:
                yield ticket, coef
        self.value = math.sqrt(step_sq_norm if step_sq_norm >= 0 else self.tickets.sq_norm)
        self.factor(step, self.value)
