"""How the compute worker's gradients leave it: to the host store and the gradient sink.

Each unit's gradient (fp32 on the device, accumulated over the step's micro-batches) goes out the
moment its backward is done (:meth:`GradOut.send`): summed over the data-parallel group first where
there is one (this worker then sends its shard, see :mod:`megatrain_ray.engine.grad_reduce`), copied
to the unit's host grad block (or a slot of the store's gradient ring) on the copy-out stream, and a
:class:`~megatrain_ray.engine.tickets.GradTicket` with its squared norm goes to the sink once the copy
is complete; a sparse layer's, only for the parts the step's routing used, with the ticket naming
the others (:mod:`megatrain_ray.engine.experts`). The waits for copies and ring slots are the worker's *grad-sender* thread's
(:meth:`GradOut.run`), so the compute never blocks on them. Two variants end the step
(:meth:`GradOut.end_step`):

- held gradients (``StoreSpec.hold_grads``): every gradient waits on the device until the step's
  norm is known, then goes through the ring in update order, each ticket carrying that norm;
- resident units (``StoreSpec.resident``, :mod:`megatrain_ray.engine.resident`): their gradients stay on the
  device and only their norms go out; the worker updates them itself with the step's norm, summed
  from every unit's as the sink sums them.
"""

from __future__ import annotations

import queue
from typing import Callable, Iterator

import torch

from ..errors import PipelineError
from .experts import ExpertTraffic
from .resident import ResidentUnits, step_sq_norm
from .policy import NONE, UnitPolicy
from .tickets import NO_PROGRESS, GradTicket, wait_while_moving


class GradOut:
    """The gradient out-path of one compute worker (see the module docstring)."""

    def __init__(self, store, backend, grad_q, grad_slot_q, timeout_s: float, resident: ResidentUnits | None,
                 policies: tuple[UnitPolicy, ...], update_order: tuple[int, ...], adapters=None,
                 traffic: ExpertTraffic | None = None):
        """policies: each unit's (:mod:`megatrain_ray.engine.policy`); the gradients of units whose
        policy has none (frozen units) are never sent; update_order: the schedule's (held gradients
        go out in it); adapters: a LoRA run's
        (:class:`~megatrain_ray.engine.adapters.DeviceAdapters`), updated at the end of each step;
        traffic: the worker's record of its sparse layers' routing, which says what of their
        gradients crosses (None: all of every gradient)."""
        self.store, self.backend = store, backend
        self.layout = store.layout
        self.grad_q, self.grad_slot_q = grad_q, grad_slot_q  # grad_slot_q: free ring slots, from the sink
        self.timeout_s = timeout_s
        self.resident = resident
        self.adapters = adapters
        self.frozen = {u for u, p in enumerate(policies) if p.gradient == NONE}
        self.policies = policies
        self.update_order = update_order
        self.traffic = traffic
        self.reducer = None
        """The worker's data-parallel group (set when it joins one), or None."""
        self.outbox: queue.Queue = queue.Queue()
        """(unit, step, slot, handle, step's squared norm, parts skipped) for the grad-sender thread; a
        callable handle takes its slot and starts its copy there (held gradients)."""
        self._held: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        """(unit, gradient [numel] on the device, its squared norm) of this step, with ``hold_grads``."""
        self._sq_norms: list[torch.Tensor] = []
        """Each unit's squared gradient norm of this step, in the order their tickets go (with resident units)."""
        self.doing = ""
        """What the grad-sender thread does now (for the error that ends it)."""

    def run(self, drain: Callable[[queue.Queue], Iterator]) -> None:
        """The grad-sender thread: each ticket goes out once its copy to the host store is complete
        (``drain``: the worker's items of a local queue until it stops)."""
        for unit, step, slot, handle, step_sq, skipped in drain(self.outbox):
            self.doing = f"sending the gradient of {self.layout.units[unit]} to the host store and the gradient sink"
            if callable(handle):  # a held gradient (_send_held): its slot and copy are taken here
                slot, handle, step_sq = handle()
            self.grad_q.put(GradTicket(unit, step, handle.result(), slot, step_sq, skipped), timeout=self.timeout_s)

    def send(self, unit: int, step: int, grad: torch.Tensor | None) -> None:
        """grad: [numel] fp32 on the device -> the unit's host grad block, then a ticket to the sink;
        None: a LoRA run's frozen unit, whose ticket carries its adapters' squared norm (:meth:`_send_adapters`).

        With a data-parallel group, the gradient is first summed over all workers, and this worker
        sends only its shard of the sum; with experimental.grad_reduce=host it sends all of its own
        gradient, to its own host copy (see :mod:`megatrain_ray.engine.grad_reduce`)."""
        if self.adapters is not None:
            return self._send_adapters(unit, step, grad)
        if unit in self.frozen:
            return
        if self.store.spec.hold_grads:  # wait on the device for the step's norm (see _send_held)
            self._held.append((unit, grad.to(self.store.spec.precision.grad), torch.dot(grad, grad)))
            return
        sq_norm = None
        if self.resident is not None:  # (one worker: no reduction below)
            sq_norm = torch.dot(grad, grad)
            self._sq_norms.append(sq_norm)
            if unit in self.resident.units:  # updated on the device at the end of the step: the sink needs its norm
                self.resident.hold(unit, grad)
                self.outbox.put((unit, step, -1, self.backend.scalar(sq_norm), -1.0, ()))
                return
        slot = self._free_slot(unit) if self.store.spec.grad_slots else -1
        host = self.store.grad_block(unit, slot, self.reducer.copy if self.reducer is not None else 0)
        ranges, skipped = None, ()
        if self.reducer is not None:
            lo, hi = self.reducer.reduce(grad)
            grad, host = grad[lo:hi], host[lo:hi]
        else:
            ranges, skipped = self._ranges(unit, step, host)
        if sq_norm is None:
            sq_norm = torch.dot(grad, grad)
        handle = self.backend.store(grad.to(host.dtype), host, sq_norm, self.layout.units[unit], ranges)
        self.outbox.put((unit, step, slot, handle, -1.0, skipped))

    def _ranges(self, unit: int, step: int, host: torch.Tensor) -> tuple[list | None, tuple[int, ...]]:
        """What of ``unit``'s gradient crosses to ``host`` (:meth:`~megatrain_ray.engine.experts.ExpertTraffic.grad_ranges`)."""
        if self.traffic is None:
            return None, ()
        return self.traffic.grad_ranges(unit, step, self.policies[unit], host.element_size())

    def _send_adapters(self, unit: int, step: int, grad: torch.Tensor | None) -> None:
        """The ticket of a unit of a LoRA run: its gradient (its adapters', or with ``grad``, that of the
        matrix it trains in full, :meth:`~megatrain_ray.engine.adapters.DeviceAdapters.hold`) stays on
        the device, summed over the data-parallel group where there is one; only a squared norm goes
        to the sink (of this worker's shard of the sum, as the sink sums a unit's shards), the whole
        one to this worker's clipping factor (the same on every worker)."""
        name = self.layout.units[unit]
        if grad is not None:
            self.adapters.hold(unit, grad)
        whole = self.adapters.gradient(name)
        if whole is None:  # a frozen unit without adapters
            sq_norm = ticket = torch.zeros((), dtype=torch.float32, device=self.backend.device)
        elif self.reducer is not None:
            lo, hi = self.reducer.reduce(whole)
            sq_norm, ticket = torch.dot(whole, whole), torch.dot(whole[lo:hi], whole[lo:hi])
        else:
            sq_norm = ticket = torch.dot(whole, whole)
        self._sq_norms.append(sq_norm)
        self.outbox.put((unit, step, -1, self.backend.scalar(ticket), -1.0, ()))

    def end_step(self, step: int, sync: bool, for_checkpoint: bool = False) -> None:
        """After the last gradient of step ``step``: send the held ones, or update the resident units
        (and with ``sync`` copy them to the host store, ``for_checkpoint``: for a checkpoint; see
        :func:`~megatrain_ray.engine.resident.sync_due`)."""
        if self.store.spec.hold_grads:
            self._send_held(step)
        if self.resident is not None:
            norms, self._sq_norms = self._sq_norms, []
            with self.backend.compute("adamw (resident units)"):
                self.resident.update(step, step_sq_norm(norms))
            if sync:
                self.resident.sync(for_checkpoint)
        if self.adapters is not None:  # summed as the sink sums the tickets' norms: the same float
            norms, self._sq_norms = self._sq_norms, []
            with self.backend.compute("adamw (adapters)"):
                self.adapters.update(step, step_sq_norm(norms))

    def _send_held(self, step: int) -> None:
        """With ``hold_grads``: the step's gradients, held on the device, through the ring in update order
        (embedding, layers, head: the next forward's first weights are updated first), every ticket with
        the step's squared norm, summed in the order the sink would have (the order they were computed).

        The waits (for the norm, for free ring slots: the sink updating) are the grad-sender thread's,
        so this step returns at once and the next step's forward runs while the updates do."""
        held, self._held = self._held, []
        total: list[float] = []

        def step_sq() -> float:
            if not total:
                total.append(0.0)
                for _, _, sq_norm in held:
                    total[0] += float(sq_norm)
            return total[0]

        def send(unit: int, grad: torch.Tensor, sq_norm: torch.Tensor, ranges):
            slot = self._free_slot(unit)
            handle = self.backend.store(grad, self.store.grad_block(unit, slot), sq_norm, self.layout.units[unit], ranges)
            return slot, handle, step_sq()

        by_unit = {unit: (grad, sq_norm) for unit, grad, sq_norm in held}
        for unit in (u for u in self.update_order if u in by_unit):
            grad, sq_norm = by_unit.pop(unit)
            ranges, skipped = self._ranges(unit, step, grad)
            self.outbox.put((unit, step, -1, lambda u=unit, g=grad, s=sq_norm, r=ranges: send(u, g, s, r), -1.0,
                             skipped))

    def _free_slot(self, unit: int) -> int:
        """A slot of the gradient ring that the sink has finished with (waits for one)."""
        try:
            return wait_while_moving(lambda t: self.grad_slot_q.get(timeout=t), self.grad_slot_q, self.timeout_s)
        except queue.Empty:
            raise PipelineError(f"the compute worker waited {self.timeout_s:.0f} s for a free gradient slot for "
                                f"{self.layout.units[unit]} while no message moved between the roles; "
                                f"{NO_PROGRESS}") from None
