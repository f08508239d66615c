"""The gradient sink: AdamW on the CPU, one unit at a time, as gradients arrive.

One loop over the run: for every step, take :class:`~megatrain_ray.engine.tickets.GradTicket` s from the
grad queue (each names a unit whose gradient is complete in its host grad block, and carries its
squared norm, taken on the device) and add them up. Without clipping each unit is updated the moment its
gradient arrives (and, when the store keeps the gradients in a ring of slots, the slot is handed
back to the compute worker right after). With clipping the factor needs the global norm, so the updates run once the last
gradient (the embedding's) is in, in the order the next step's forward needs them — embedding,
layer 0, 1, ... — so the next forward can start on layer 0 while later layers are still updating;
unless the compute worker held the gradients on its device until the norm was known
(``StoreSpec.hold_grads``): then they arrive in that order through the ring, each ticket carrying
the step's norm, and each unit is clipped and updated as it arrives.
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
:class:`~megatrain_ray.engine.store.HostStore`). The same arithmetic, so the same bits; the next
step's gradients land in the stream blocks, which the second pass does not touch.

With several compute workers on the node, a unit is complete once every worker's ticket for it is
in: each for its shard of the all-reduced gradient, or (experimental.grad_reduce=host) for its own
whole gradient, which the sink then sums (:func:`~megatrain_ray.engine.grad_reduce.sum_copies`).
With a sharded optimizer across nodes (:mod:`megatrain_ray.engine.shards`) the updates also wait
for the last gradient, and the sink updates only its own units, receiving the others'.

Each unit's update is its policy's (:mod:`megatrain_ray.engine.policy`): a host optimizer of the
one protocol of :mod:`megatrain_ray.engine.updates` (exact, split, compact), or none here for the
units resident on the compute worker's device, whose tickets carry only their norms. So the loop
reads: take the step's tickets -> the norm -> the clipping factor -> for each unit in update
order, its optimizer's update. A sparse layer's ticket may name parts whose gradient did not cross
(routed experts no token chose): their ranges of the gradient block are zeroed first, so the update
is that of their zero gradient (:mod:`megatrain_ray.engine.experts`). Checkpoints are started at step boundaries and written beside the
updates (:mod:`megatrain_ray.engine.checkpointing`).
"""

from __future__ import annotations

import math
import queue
import time
from concurrent.futures import ThreadPoolExecutor

from ..config import lr_at
from ..errors import Diverged, PipelineError
from . import affinity
from .checkpointing import SinkCheckpoints
from .experts import zero_skipped
from .grad_reduce import rendezvous, sum_copies
from .optim import AdamWRunner, step_clipping
from .policy import NONE
from .settings import SinkSettings
from .shards import OptimizerShards
from .store import HostStore, StoreSpec
from .tickets import NO_PROGRESS, GradTicket, wait_while_moving
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
        :mod:`megatrain_ray.engine.shards`)."""
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
        self.frozen = settings.frozen
        """A LoRA run's base units, in update order (:data:`~megatrain_ray.engine.policy.FROZEN`)."""
        self.after_norm = settings.after_norm
        """Whether the updates wait for the step's norm (see :attr:`SinkSettings.after_norm`)."""
        self.tickets_per_unit = settings.workers
        """Tickets per unit and step: one per compute worker of the node, each for its shard of the
        summed gradient (see :mod:`megatrain_ray.engine.grad_reduce`), or with ``host_sum`` for its
        whole gradient in a host copy of its own, which this sink sums (experimental.grad_reduce=host)."""
        self.host_sum = settings.host_sum
        self.threads = max(1, settings.threads)
        self.spans: list[tuple] = []
        self.checkpoints = SinkCheckpoints(self.store, checkpoint, writes_checkpoints, stats_q, timeout_s,
                                           self.order if self.after_norm else self.order[::-1], spec.resident, grad_q)
        self.sharding: OptimizerShards | None = None
        """This sink's part of the sharded optimizer (:meth:`join_shards`), or None: it updates every unit."""
        self._set_runner(settings.threads)
        self._sum_pool = ThreadPoolExecutor(self.threads, thread_name_prefix="grad-sum") if self.host_sum else None
        self._second: list[int] = []
        """Units whose update's second pass is still to run (:meth:`_finish`)."""
        for slot in range(spec.grad_slots):  # the gradient ring starts empty: every slot is free
            grad_slot_q.put(slot, timeout=timeout_s)

    def _set_runner(self, threads: int) -> None:
        """The AdamW kernel on ``threads`` threads, and each unit's optimizer over it."""
        self.runner = AdamWRunner(threads)
        self.optimizers = {u: host_optimizer(self.policies[u].optimizer, self.store, self.runner, self.optim,
                                             self.settings.total_steps) for u in self.order}

    def run(self, start_step: int, end_step: int) -> int:
        """Apply the updates of steps [start_step, end_step); returns the number of steps done.

        After each step, puts {step, grad_norm, lr, update_busy_s, spans} on the stats queue; after
        each checkpoint, {checkpoint: path, step, save_s}.
        """
        for step in range(start_step, end_step):
            self._boundary(step, start_step, end_step)
            lr = lr_at(self.optim, step, self.settings.total_steps)
            waiting, held = set(), None
            for ticket in self._tickets(step):
                if ticket.skipped:  # a sparse layer's experts without a token: their zero gradient did not cross
                    zero_skipped(self.store.grad_block(ticket.unit, ticket.slot), self.layout.records[ticket.unit],
                                 ticket.skipped)
                held = ticket.step_sq_norm if ticket.step_sq_norm != -1.0 else None  # the step's, with held gradients
                coef = 1.0 if held is None else self._clipping(step, math.sqrt(held))
                if ticket.unit not in self.optimizers:
                    continue  # updated on the device (its ticket carries only its norm), or never
                if self.after_norm and held is None:
                    waiting.add(ticket.unit)
                    continue
                self._update(ticket.unit, step, coef, ticket.slot)
            norm = math.sqrt(self.sq_norm if held is None else held)
            coef = self._clipping(step, norm)
            for unit in (u for u in self.order if u in waiting):
                self._update(unit, step, coef)
            for unit in self.frozen:  # never updated: the next step may stream it
                self.store.set_version(unit, step + 1)
            if self.sharding is not None:
                self.sharding.end_step()
            self.stats_q.put({"step": step, "grad_norm": norm, "lr": lr,
                              "update_busy_s": sum(e - b for _, _, b, e, _ in self.spans),
                              "spans": self.spans}, timeout=self.timeout_s)
            self.spans = []  # the second passes below are reported with the next step, as they run beside it
            self._finish(step)
        if self.sharding is not None:  # the export and any checkpoint after the run need every state
            self.sharding.gather_states(end_step, len(self.layout.units))
        self._boundary(end_step, start_step, end_step)
        self.checkpoints.report(wait=True)
        return end_step - start_step

    def _tickets(self, step: int):
        """The ticket of each unit of ``step`` once its gradient is whole: every worker's ticket for it
        is in (and, with ``host_sum``, their copies summed). Meanwhile ``sq_norm`` sums the step's
        squared norms, ticket by ticket in the order they came (a host sum's once it is done)."""
        self.sq_norm = 0.0
        pending = dict.fromkeys((u for u, p in enumerate(self.policies) if p.gradient != NONE), self.tickets_per_unit)
        while pending:
            ticket = self._get()
            if ticket.step != step or ticket.unit not in pending:
                raise PipelineError(f"unexpected gradient of {self.layout.units[ticket.unit]} for step "
                                    f"{ticket.step} while collecting step {step}.")
            if not self.host_sum:
                self.sq_norm += ticket.sq_norm
            pending[ticket.unit] -= 1
            if pending[ticket.unit]:
                continue  # other workers' shards of this unit are still on their way
            del pending[ticket.unit]
            if self.host_sum and ticket.unit in self.optimizers:
                self.sq_norm += self._sum_copies(ticket.unit)
            yield ticket

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
        return node

    def close(self) -> None:
        """Stop the AdamW thread pool (an actor's process ends with it anyway)."""
        self.runner.close()
        if self._sum_pool is not None:
            self._sum_pool.shutdown()
        if self.sharding is not None:
            self.sharding.close()

    def pin_cpus(self, cpus: list[int], threads: int) -> int:
        """Run every thread of the sink on ``cpus`` from now on, AdamW on ``threads`` of them (see
        :mod:`megatrain_ray.engine.affinity`); returns the threads pinned."""
        if threads != self.runner.threads:
            self.runner.close()
            self._set_runner(threads)
        return affinity.pin_process(cpus)

    def _sum_copies(self, unit: int) -> float:
        """Sum the workers' host copies of ``unit``'s gradient into its grad block; its squared norm."""
        start = time.time()
        copies = [self.store.grad_block(unit, -1, k) for k in range(self.tickets_per_unit)]
        sq_norm = sum_copies(copies, self._sum_pool, self.threads)
        self.spans.append(("adamw", f"sum {self.layout.units[unit]}", start, time.time(), 0))
        return sq_norm

    def _boundary(self, step: int, start_step: int, end_step: int) -> None:
        """The boundary after ``step`` updates: report a save that has completed; start the
        checkpoint the plan asks for there (with a sharded optimizer, every node's AdamW states
        gathered first)."""
        self.checkpoints.report()
        if self.checkpoints.due(step, start_step, end_step):
            self.checkpoints.report(wait=True)
            if self.sharding is not None:
                self.sharding.gather_states(step, len(self.layout.units))
            self.checkpoints.start(step)

    def _get(self) -> GradTicket:
        try:
            return wait_while_moving(lambda t: self.grad_q.get(timeout=t), self.grad_q, self.timeout_s)
        except queue.Empty:
            raise PipelineError(f"the gradient sink waited {self.timeout_s:.0f} s for a gradient while no message "
                                f"moved between the roles; {NO_PROGRESS}") from None

    def _update(self, unit: int, step: int, coef: float, slot: int = -1) -> None:
        """Apply step ``step``'s update to ``unit`` (clipped by ``coef``; its gradient in ring slot
        ``slot``, or -1: its grad block) by its optimizer and bump the versions it completes; with a
        sharded optimizer, only where this node owns it, then exchanged (:mod:`megatrain_ray.engine.shards`)."""
        self.doing = (step, unit)
        self.checkpoints.before_update(unit)  # the checkpoint being written has this unit's bytes
        if self.sharding is None or self.sharding.owns(unit):
            start = time.time()
            if self.optimizers[unit].update(unit, self.store.grad_block(unit, slot), coef, step):
                self.store.set_version(unit, step + 1)
            else:  # its stream copy and moments: the master weights follow in the second pass
                self.store.set_stream_version(unit, step + 1)
                self._second.append(unit)
            self.spans.append(("adamw", self.layout.units[unit], start, time.time(), 0))
        if self.sharding is not None:
            self.sharding.share(unit, step + 1)
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
            self.spans.append(("adamw", self.layout.units[unit] + " master", start, time.time(), 0))
