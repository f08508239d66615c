"""How the compute worker's gradients leave it: to the host store and the gradient sink.

Each unit's gradient (fp32 on the device, accumulated over the step's micro-batches) goes out the
moment its backward is done (:meth:`GradOut.send`), by the sender its policy chose once, when the
worker was built (:meth:`GradOut.sender_of`):

- :class:`ToHost` (weights streamed, gradient host): summed over the data-parallel group first
  (this worker then sends its shard, see :mod:`megatrain_ray.engine.grad_reduce`; alone, in a
  :class:`~megatrain_ray.engine.compute.worker_group.GroupOfOne`, all of its own gradient),
  copied to the unit's host grad block (or a slot of the store's gradient ring) on the copy-out
  stream, and a :class:`~megatrain_ray.engine.tickets.GradTicket` with its squared norm goes to the
  sink once the copy is complete; a sparse layer's (policy ``experts: routed``), only for the parts
  the step's routing used, with the ticket naming the others (:mod:`megatrain_ray.engine.experts`);
- :class:`HeldToHost` (the same, with ``StoreSpec.hold_grads``): the gradient waits on the device
  until the step's norm is known, then goes through the ring in update order, each ticket carrying
  that norm (:meth:`GradOut.end_step`);
- :class:`NormOnly` (gradient device, optimizer device: a resident unit, :mod:`megatrain_ray.engine.compute.resident`,
  or a streamed one updated on the device, :mod:`megatrain_ray.engine.compute.device_updates`): the
  gradient stays on the device and only its norm goes out; the worker updates the unit itself at
  the end of the step with the step's norm, summed from every unit's as the sink sums them;
- :class:`AdapterNorm` (every unit of a LoRA run, :mod:`megatrain_ray.engine.compute.adapters`): the
  gradient of its adapters (or of the matrix it trains in full) stays on the device; only its
  squared norm goes out (zero for a frozen unit without adapters), and the adapters are updated at
  the end of the step as resident units are (a run without LoRA holds the empty set,
  :class:`~megatrain_ray.engine.compute.adapters.NoAdapters`, which covers no unit);
- :class:`Nothing` (a unit whose policy has no gradient): no ticket; the sink waits for none.

The waits for copies and ring slots are the worker's *grad-sender* thread's (:meth:`GradOut.run`),
so the compute never blocks on them.
"""

from __future__ import annotations

import queue
import threading

import torch

from ...errors import PipelineError
from ..experts import ExpertTraffic
from .device_updates import NoStreamedUpdates, StreamedUpdates
from .resident import NoResidentUnits, ResidentUnits, step_sq_norm
from ..policy import NONE, ROUTED, UnitPolicy
from .worker_group import GroupOfOne
from ..tickets import NO_PROGRESS, GradTicket, drain, wait_while_moving


class GradOut:
    """The gradient out-path of one compute worker (see the module docstring)."""

    def __init__(self, store, backend, grad_q, grad_slot_q, timeout_s: float,
                 resident: ResidentUnits | NoResidentUnits, policies: tuple[UnitPolicy, ...],
                 update_order: tuple[int, ...], adapters, traffic: ExpertTraffic,
                 device_updates: StreamedUpdates | NoStreamedUpdates):
        """resident: the units resident on the worker's device (the empty set without), updated at the end
        of each step; device_updates: the streamed units updated on its device (the empty set without),
        updated after them; policies: each unit's (:mod:`megatrain_ray.engine.policy`), which picks its sender;
        update_order: the schedule's (held gradients go out in it); adapters: a LoRA run's
        (:class:`~megatrain_ray.engine.compute.adapters.DeviceAdapters`; the empty set without), updated at
        the end of each step; traffic: the worker's record of its sparse layers' routing, which says
        what of their gradients crosses."""
        self.store, self.backend = store, backend
        self.layout = store.layout
        self.grad_q, self.grad_slot_q = grad_q, grad_slot_q  # grad_slot_q: free ring slots, from the sink
        self.timeout_s = timeout_s
        self.resident = resident
        self.device_updates = device_updates
        self.adapters = adapters
        self.policies = policies
        self.update_order = update_order
        self.traffic = traffic
        self.reducer: GroupOfOne = GroupOfOne()
        """The worker's data-parallel group (replaced when it joins one)."""
        self.outbox: queue.Queue = queue.Queue()
        """(unit, step, what the ticket needs: a callable giving (slot, handle of its squared norm, the
        step's squared norm), parts skipped) for the grad-sender thread."""
        self.held: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        """(unit, gradient [numel] on the device, its squared norm) of this step, with ``hold_grads``."""
        self.sq_norms: list[torch.Tensor] = []
        """Each unit's squared gradient norm of this step, in the order their tickets go (what the
        units updated on the device, resident ones or adapters, are clipped by)."""
        self.senders = tuple(self.sender_of(unit, policy) for unit, policy in enumerate(policies))
        """Each unit's sender, chosen once by its policy."""
        self.step_ends = (*((self._send_held,) if store.spec.hold_grads else ()), self._update_on_device)
        """What ends each step (:meth:`end_step`): the held gradients sent; the resident units and the
        adapters updated."""
        self.doing = ""
        """What the grad-sender thread does now (for the error that ends it)."""

    def sender_of(self, unit: int, policy: UnitPolicy) -> Sender:
        """The sender of ``unit``, of ``policy`` (see the module docstring)."""
        if unit in self.adapters.covered:  # every unit of a LoRA run
            return AdapterNorm(self)
        if policy.gradient == NONE:
            return Nothing(self)
        if unit in self.device_updates.units:  # streamed, gradient and optimizer on the device
            return NormOnly(self, self.device_updates)
        if self.store.spec.hold_grads:
            return HeldToHost(self)
        if unit in self.resident.units:  # weights resident, gradient device
            return NormOnly(self, self.resident)
        return ToHost(self)

    def run(self, stop: threading.Event) -> None:
        """The grad-sender thread: each ticket goes out once its copy to the host store is complete,
        until the worker sets ``stop`` and the outbox is empty."""
        for unit, step, parts, skipped in drain(self.outbox, stop):
            self.doing = f"sending the gradient of {self.layout.units[unit]} to the host store and the gradient sink"
            slot, handle, step_sq = parts()  # a held gradient's slot and copy are taken here
            self.grad_q.put(GradTicket(unit, step, handle.result(), slot, step_sq, skipped), timeout=self.timeout_s)

    def send(self, unit: int, step: int, grad: torch.Tensor | None) -> None:
        """grad: [numel] fp32 on the device (None: a LoRA run's frozen unit, whose weights get no
        gradient) -> out by the unit's sender."""
        self.senders[unit].send(unit, step, grad)

    def end_step(self, step: int, sync: bool, for_checkpoint: bool = False) -> None:
        """After the last gradient of step ``step``: send the held ones, or update the resident units
        (and with ``sync`` copy them to the host store, ``for_checkpoint``: for a checkpoint; see
        :func:`~megatrain_ray.engine.compute.resident.sync_due`) or the adapters."""
        norms, self.sq_norms = self.sq_norms, []  # summed as the sink sums the tickets' norms: the same float
        for end in self.step_ends:
            end(step, norms, sync, for_checkpoint)

    def _update_on_device(self, step: int, norms: list, sync: bool, for_checkpoint: bool) -> None:
        """The resident units', the streamed units' updated on the device (after the resident units' copy,
        which a checkpoint's copy waits for first) and the adapters' updates, with the step's norm (an
        empty set: nothing)."""
        self.resident.end_step(step, norms, sync, for_checkpoint)
        self.device_updates.end_step(step, norms, sync, for_checkpoint)
        self.adapters.end_step(step, norms, self.backend)

    def _send_held(self, step: int, norms: list, sync: bool, for_checkpoint: bool) -> None:
        """With ``hold_grads``: the step's gradients, held on the device, through the ring in update order
        (embedding, layers, head: the next forward's first weights are updated first), every ticket with
        the step's squared norm: every unit's (``norms``: the held ones' and those of the streamed units
        updated on the device, whose tickets went during the backward), summed in the order they were
        computed, as the sink sums tickets and the device updates sum ``norms``: the same float.

        The waits (for the norm, for free ring slots: the sink updating) are the grad-sender thread's,
        so this step returns at once and the next step's forward runs while the updates do."""
        held, self.held = self.held, []
        total: list[float] = []

        def step_sq() -> float:  # every unit's, the held ones' and those updated on the device
            if not total:
                total.append(step_sq_norm(norms))
            return total[0]

        def send(unit: int, grad: torch.Tensor, sq_norm: torch.Tensor, ranges):
            slot = self.free_slot(unit)
            handle = self.backend.store(grad, self.store.grad_block(unit, slot), sq_norm, self.layout.units[unit], ranges)
            return slot, handle, step_sq()

        by_unit = {unit: (grad, sq_norm) for unit, grad, sq_norm in held}
        for unit in (u for u in self.update_order if u in by_unit):
            grad, sq_norm = by_unit.pop(unit)
            ranges, skipped = self.ranges(unit, step, grad)
            self.outbox.put((unit, step, lambda u=unit, g=grad, s=sq_norm, r=ranges: send(u, g, s, r), skipped))

    def ranges(self, unit: int, step: int, host: torch.Tensor) -> tuple[list | None, tuple[int, ...]]:
        """What of ``unit``'s gradient crosses to ``host``: a sparse layer's routed parts under its policy's
        ``experts: routed`` (:meth:`~megatrain_ray.engine.experts.ExpertTraffic.grad_ranges`), else all of it
        (under ``all``: a data-parallel worker's shard of the group's sum, whose bytes no expert counts)."""
        if self.policies[unit].experts != ROUTED:
            return None, ()
        return self.traffic.grad_ranges(unit, step, self.policies[unit], host.element_size())

    def free_slot(self, unit: int) -> int:
        """A slot of the gradient ring that the sink has finished with (waits for one)."""
        try:
            return wait_while_moving(lambda t: self.grad_slot_q.get(timeout=t), self.grad_slot_q, self.timeout_s)
        except queue.Empty:
            raise PipelineError(f"the compute worker waited {self.timeout_s:.0f} s for a free gradient slot for "
                                f"{self.layout.units[unit]} while no message moved between the roles; "
                                f"{NO_PROGRESS}") from None


class Sender:
    """How one unit's gradient leaves the worker (see the module docstring)."""

    def __init__(self, out: GradOut):
        self.out = out

    def send(self, unit: int, step: int, grad: torch.Tensor | None) -> None:
        raise NotImplementedError


class ToHost(Sender):
    """To the unit's host grad block (or a ring slot), then a ticket with its squared norm."""

    def send(self, unit: int, step: int, grad: torch.Tensor) -> None:
        out = self.out
        slot = out.free_slot(unit) if out.store.spec.grad_slots else -1
        host = out.store.grad_block(unit, slot, out.reducer.copy)
        lo, hi = out.reducer.reduce(grad)  # this worker's shard of the group's sum (alone: all of its own)
        grad, host = grad[lo:hi], host[lo:hi]
        ranges, skipped = out.ranges(unit, step, host)
        sq_norm = torch.dot(grad, grad)
        out.sq_norms.append(sq_norm)
        handle = out.backend.store(grad.to(host.dtype), host, sq_norm, out.layout.units[unit], ranges)
        out.outbox.put((unit, step, lambda: (slot, handle, -1.0), skipped))


class HeldToHost(Sender):
    """Held on the device until the step's norm is known (:meth:`GradOut._send_held`)."""

    def send(self, unit: int, step: int, grad: torch.Tensor) -> None:
        out = self.out
        sq_norm = torch.dot(grad, grad)
        out.sq_norms.append(sq_norm)
        out.held.append((unit, grad.to(out.store.spec.precision.grad), sq_norm))


class NormOnly(Sender):
    """A unit updated on the device: its gradient stays there, for its updater (the resident units, or
    the streamed units updated on the device) at the end of the step; only its squared norm goes to the sink."""

    def __init__(self, out: GradOut, updater):
        super().__init__(out)
        self.updater = updater

    def send(self, unit: int, step: int, grad: torch.Tensor) -> None:
        out = self.out
        sq_norm = torch.dot(grad, grad)
        out.sq_norms.append(sq_norm)
        self.updater.take_grad(unit, grad)
        scalar = out.backend.scalar(sq_norm)
        out.outbox.put((unit, step, lambda: (-1, scalar, -1.0), ()))


class AdapterNorm(Sender):
    """The ticket of a unit of a LoRA run: its gradient (its adapters', or with ``grad``, that of the
    matrix it trains in full, :meth:`~megatrain_ray.engine.compute.adapters.DeviceAdapters.take_grad`) stays on
    the device, summed over the data-parallel group where there is one; only a squared norm goes
    to the sink (of this worker's shard of the sum, as the sink sums a unit's shards), the whole
    one to this worker's clipping factor (the same on every worker)."""

    def send(self, unit: int, step: int, grad: torch.Tensor | None) -> None:
        out = self.out
        if grad is not None:
            out.adapters.take_grad(unit, grad)
        whole = out.adapters.gradient(out.layout.units[unit])
        if whole is None:  # a frozen unit without adapters
            sq_norm = ticket = torch.zeros((), dtype=torch.float32, device=out.backend.device)
        else:
            lo, hi = out.reducer.reduce(whole)  # summed over the group (alone: itself, all of it this worker's)
            sq_norm = torch.dot(whole, whole)
            ticket = sq_norm if hi - lo == whole.numel() else torch.dot(whole[lo:hi], whole[lo:hi])
        out.sq_norms.append(sq_norm)
        scalar = out.backend.scalar(ticket)
        out.outbox.put((unit, step, lambda: (-1, scalar, -1.0), ()))


class Nothing(Sender):
    """A unit whose policy has no gradient: nothing goes out, and the sink waits for no ticket."""

    def send(self, unit: int, step: int, grad: torch.Tensor | None) -> None:
        pass
