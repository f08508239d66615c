"""The gradient sink: AdamW on the CPU, one unit at a time, as gradients arrive.

One loop over the run; each step reads: take the step's tickets -> the norm -> the clipping factor
-> each unit's update by its optimizer. A :class:`~megatrain_ray.engine.tickets.GradTicket` names
a unit whose gradient is complete in its host grad block (or a slot of the store's gradient ring)
and carries its squared norm, taken on the device; the step's tickets and norm come from
:mod:`megatrain_ray.engine.sink.step_gradients`, which also says when each unit's update may run and
with which factor. Without clipping each unit is updated the moment its gradient arrives. With
clipping the factor needs the global norm, so the updates run once the last gradient (the
embedding's) is in, in the order the next step's forward needs them — embedding, layer 0, 1, ... —
so the next forward can start on layer 0 while later layers are still updating; unless the compute
worker held the gradients on its device until the norm was known (``StoreSpec.hold_grads``): then
they arrive in that order through the ring, each ticket carrying the step's norm, and each unit is
clipped and updated as it arrives. Every update takes the one path (:meth:`GradientSink._update`):
its optimizer's ``update``, the versions that completes, then the ring slot handed back to the
compute worker (a release callback; nothing to hand back without a ring).
After a unit's update its stream copy is refreshed and only then its version bumped, which is what
lets the prefetcher stream it for the next step.

**Split updates.** Those deferred updates are what the next forward waits on, layer by layer: at
7B AdamW moves 28 bytes per parameter (~50 ms a layer on the H200 box's 16 cores) against ~46 ms
of forward per layer on the GPU. With an fp32 master and a bf16 stream copy (``SplitAdamW``) each
is run in two passes (:meth:`~megatrain_ray.engine.optim.AdamWRunner.update_stream`, then
:meth:`~megatrain_ray.engine.optim.AdamWRunner.update_master`): the first writes the moments and
the stream copy (24 bytes per parameter) and bumps the unit's stream version, which is all the
forward needs; once every unit has had it and the step's stats are out, the second writes the
master weights from the new moments (16 bytes per parameter) while the next step's forward and
backward run, and bumps the unit's state version (what checkpoints wait for, see
:class:`~megatrain_ray.engine.store.host_store.HostStore`). The same arithmetic, so the same bits; the next
step's gradients land in the stream blocks, which the second pass does not touch.

With several compute workers on the node, a unit is complete once every worker's ticket for it is
in: each for its shard of the all-reduced gradient, or (experimental.grad_reduce=host) for its own
whole gradient, which the sink then sums (:class:`~megatrain_ray.engine.sink.step_gradients.HostSums`).
With a sharded optimizer across nodes (:mod:`megatrain_ray.engine.sink.shards`) the updates also wait
for the last gradient, and each unit's optimizer is wrapped
(:class:`~megatrain_ray.engine.sink.shards.ShardedOptimizer`): the sink updates only its own units,
receiving the others'.

Each unit's update is its policy's (:mod:`megatrain_ray.engine.policy`): a host optimizer of the
one protocol of :mod:`megatrain_ray.engine.sink.updates` (exact, split, compact), or none here for the
units the compute worker updates on its device (resident ones, and streamed ones under optim.placement
device, :mod:`megatrain_ray.engine.compute.device_updates`), whose tickets carry only their norms. A sparse
layer's ticket may name parts whose gradient did not cross (routed experts no token chose): their
ranges of the gradient block are zeroed first, so the update is that of their zero gradient
(:mod:`megatrain_ray.engine.experts`). Checkpoints are started at step boundaries and written beside the
updates (:mod:`megatrain_ray.engine.sink.checkpointing`).
"""

from __future__ import annotations

import queue
import time

from ...config import lr_at
from ...errors import Diverged, PipelineError
from .. import affinity
from .checkpointing import SinkCheckpoints
from ..grad_reduce import rendezvous
from ..optim import AdamWRunner, step_clipping
from ..policy import STREAMED_ON_DEVICE
from ..settings import SinkSettings
from .shards import UNSHARDED, OptimizerShards, ShardedOptimizer
from .step_gradients import AsArrived, Carried, HostSums, InUpdateOrder, StepTickets
from ..store.host_store import HostStore, StoreSpec
from ..tickets import NO_PROGRESS, GradTicket, wait_while_moving
from .updates import host_optimizer


class GradientSink:
    """Plain class; made a Ray actor (with several CPUs for the AdamW kernel) at spawn."""

    doing: tuple[int, int] | None = None
    """(step, unit) of the update being applied: what the dashboard shows (orchestration.labels)."""

    def __init__(self, spec: StoreSpec, settings: SinkSettings, grad_q, stats_q, grad_slot_q=None,
                 checkpoint=None, writes_checkpoints: bool = True):
        """spec: the node's store; settings: the sink's part of the run; grad_q: gradient tickets from
        the node's compute workers; stats_q: to the driver; grad_slot_q: the gradient ring's free slots,
        back to the compute worker (None without a ring); checkpoint: the run's
        :class:`~megatrain_ray.io.checkpoint.CheckpointSettings` or None, written here with ``writes_checkpoints``
        (the first node's sink; the others only hand their AdamW states over at its boundaries, see
        :mod:`megatrain_ray.engine.sink.shards`)."""
        self.settings = settings
        self.store = HostStore(spec)
        self.layout = self.store.layout
        self.optim = settings.optim
        self.grad_q, self.stats_q, self.grad_slot_q = grad_q, stats_q, grad_slot_q
        self.timeout_s = timeout_s = settings.timeout_s
        self.policies = settings.policies
        """Each unit's :class:`~megatrain_ray.engine.policy.UnitPolicy`."""
        self.order = settings.updates
        """The units this sink updates, in update order."""
        self.version_only = settings.version_only
        """A LoRA run's base units, in update order (:data:`~megatrain_ray.engine.policy.FROZEN`)."""
        self.intervals: list[tuple] = []
        self.tickets = (HostSums(self.store, self.policies, settings.workers, self._get, self.order,
                                 max(1, settings.optimizer_threads), self._note) if settings.host_sum
                        else StepTickets(self.store, self.policies, settings.workers, self._get))
        """The step's whole tickets: one per compute worker and unit (see :mod:`megatrain_ray.engine.sink.step_gradients`)."""
        norm = Carried if spec.hold_grads else InUpdateOrder if settings.after_norm else AsArrived
        self.step_norm = norm(self.tickets, self.order, self._clipping)
        """When each unit is updated, with which clipping factor (:mod:`megatrain_ray.engine.sink.step_gradients`)."""
        by_worker = (*spec.resident, *(u for u, p in enumerate(self.policies) if p == STREAMED_ON_DEVICE))
        """The units the compute worker updates, whose state a checkpoint waits for and writes first."""
        self.checkpoints = SinkCheckpoints(self.store, checkpoint, writes_checkpoints, stats_q, timeout_s,
                                           self.order if settings.after_norm else self.order[::-1], by_worker, grad_q)
        self.sharding: OptimizerShards = UNSHARDED
        """This sink's part of the sharded optimizer (:meth:`join_shards`), or UNSHARDED: it updates every unit."""
        self._set_runner(settings.optimizer_threads)
        self.release = self._free_slot if grad_slot_q is not None else _keep
        """Hands a gradient ring slot back to the compute worker once its update has read it."""
        self._versions = {True: self._whole, False: self._first_pass, None: _elsewhere}
        """What an update's result completes (:meth:`_update`)."""
        self._second: list[int] = []
        """Units whose update's second pass is still to run (:meth:`_finish`)."""
        for slot in range(spec.grad_slots):  # the gradient ring starts empty: every slot is free
            grad_slot_q.put(slot, timeout=timeout_s)

    def _set_runner(self, threads: int) -> None:
        """The AdamW kernel on ``threads`` threads, and each unit's optimizer over it (with a sharded
        optimizer, wrapped: :class:`~megatrain_ray.engine.sink.shards.ShardedOptimizer`)."""
        self.runner = AdamWRunner(threads)
        self.optimizers = {u: host_optimizer(self.policies[u].optimizer, self.store, self.runner, self.optim,
                                             self.settings.total_steps) for u in self.order}
        if self.sharding is not UNSHARDED:
            self.optimizers = {u: ShardedOptimizer(o, self.sharding) for u, o in self.optimizers.items()}

    def run(self, start_step: int, end_step: int) -> int:
        """Apply the updates of steps [start_step, end_step); returns the number of steps done.

        After each step, puts {step, grad_norm, lr, update_busy_s, intervals} on the stats queue; after
        each checkpoint, {checkpoint: path, step, save_s}.
        """
        for step in range(start_step, end_step):
            self._boundary(step, start_step, end_step)
            for ticket, coef in self.step_norm.updates(step):  # the tickets -> the norm -> the clipping factor
                self._update(ticket, step, coef)
            self._end_step(step, self.step_norm.value)
        self.sharding.gather_states(end_step, len(self.layout.units))  # what the export and a checkpoint need
        self._boundary(end_step, start_step, end_step)
        self.checkpoints.report(wait=True)
        return end_step - start_step

    def _update(self, ticket: GradTicket, step: int, coef: float) -> None:
        """Apply step ``step``'s update to the ticket's unit (clipped by ``coef``; its gradient in the
        ticket's ring slot, or -1: its grad block) by its optimizer, set the versions it completes,
        and hand the ring slot back."""
        unit = ticket.unit
        self.doing = (step, unit)
        self.checkpoints.before_update(unit)  # the checkpoint being written has this unit's bytes
        start = time.time()
        done = self.optimizers[unit].update(unit, self.store.grad_block(unit, ticket.slot), coef, step)
        self._versions[done](unit, step, start)
        self.release(ticket.slot)

    def _whole(self, unit: int, step: int, start: float) -> None:
        """The update is whole: the unit is current for the next step."""
        self.store.set_version(unit, step + 1)
        self._note(self.layout.units[unit], start, time.time())

    def _first_pass(self, unit: int, step: int, start: float) -> None:
        """Its stream copy and moments are: the master weights follow in the second pass (:meth:`_finish`)."""
        self.store.set_stream_version(unit, step + 1)
        self._second.append(unit)
        self._note(self.layout.units[unit], start, time.time())

    def _end_step(self, step: int, norm: float) -> None:
        """After step ``step``'s updates: the version-only units (:data:`~megatrain_ray.engine.policy.FROZEN`) made current, the shards' exchange awaited,
        the step's stats out, then the second passes."""
        for unit in self.version_only:  # never updated: the next step may stream it
            self.store.set_version(unit, step + 1)
        self.sharding.end_step()
        self.stats_q.put({"step": step, "grad_norm": norm, "lr": lr_at(self.optim, step, self.settings.total_steps),
                          "update_busy_s": sum(e - b for _, _, b, e, _ in self.intervals),
                          "intervals": self.intervals}, timeout=self.timeout_s)
        self.intervals = []  # the second passes below are reported with the next step, as they run beside it
        self._finish(step)

    def _clipping(self, step: int, norm: float) -> float:
        """Step ``step``'s clipping factor (:func:`step_clipping`); where the norm is not finite, the save
        being written (the last good weights: this step's update is never applied) is finished before
        the error is raised: the run stops, and its newest checkpoint is whole."""
        try:
            return step_clipping(step, norm, self.optim.max_grad_norm)
        except Diverged:
            try:
                self.checkpoints.report(wait=True)
            except Exception:  # noqa: BLE001 (that save failed: the divergence is still what stops the run)
                pass
            raise

    def rendezvous(self) -> tuple[str, int]:
        """(this node's IP, a free port on it): where the sinks' group meets (the first node's)."""
        return rendezvous()

    def join_shards(self, node: int, nodes: int, address: str, port: int) -> int:
        """Join the other nodes' sinks as a sharded optimizer (all call this at once); returns node."""
        self.sharding = OptimizerShards(self.store, node, nodes, address, port, self.timeout_s)
        self.optimizers = {u: ShardedOptimizer(o, self.sharding) for u, o in self.optimizers.items()}
        return node

    def close(self) -> None:
        """Stop the AdamW thread pool (an actor's process ends with it anyway)."""
        self.runner.close()
        self.tickets.close()
        self.sharding.close()

    def pin_cpus(self, cpus: list[int], threads: int) -> int:
        """Run every thread of the sink on ``cpus`` from now on, AdamW on ``threads`` of them (see
        :mod:`megatrain_ray.engine.affinity`); returns the threads pinned."""
        if threads != self.runner.threads:
            self.runner.close()
            self._set_runner(threads)
        return affinity.pin_process(cpus)

    def _note(self, what: str, start: float, end: float) -> None:
        """An AdamW span of this step (a unit's update, or a host sum)."""
        self.intervals.append(("adamw", what, start, end, 0))

    def _boundary(self, step: int, start_step: int, end_step: int) -> None:
        """The boundary after ``step`` updates: report a save that has completed; start the
        checkpoint the plan asks for there (with a sharded optimizer, every node's AdamW states
        gathered first)."""
        self.checkpoints.report()
        if self.checkpoints.due(step, start_step, end_step):
            self.checkpoints.report(wait=True)
            self.sharding.gather_states(step, len(self.layout.units))
            self.checkpoints.start(step)

    def _get(self) -> GradTicket:
        try:
            return wait_while_moving(lambda t: self.grad_q.get(timeout=t), self.grad_q, self.timeout_s)
        except queue.Empty:
            raise PipelineError(f"the gradient sink waited {self.timeout_s:.0f} s for a gradient while no message "
                                f"moved between the roles; {NO_PROGRESS}") from None

    def _free_slot(self, slot: int) -> None:
        """Ring slot ``slot`` back to the compute worker (-1: the unit's own grad block, nothing to hand back)."""
        if slot >= 0:
            self.grad_slot_q.put(slot, timeout=self.timeout_s)

    def _finish(self, step: int) -> None:
        """The second passes of step ``step``'s split updates, in update order, while the next step runs."""
        second, self._second = self._second, []
        for unit in second:
            self.doing = (step, unit)
            self.checkpoints.before_update(unit)
            start = time.time()
            self.optimizers[unit].finish(unit, step)
            self.store.set_state_version(unit, step + 1)
            self._note(self.layout.units[unit] + " master", start, time.time())


def _keep(slot: int) -> None:
    """No gradient ring: a grad block is the unit's own, nothing to hand back."""


def _elsewhere(unit: int, step: int, start: float) -> None:
    """Another node's unit (a sharded optimizer): its weights, once received, set its version."""
