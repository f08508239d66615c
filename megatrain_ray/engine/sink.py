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
of forward per layer on the GPU. With an fp32 master and a bf16 stream copy (``split_update``) each
is run in two passes (:meth:`~megatrain_ray.engine.optim.AdamWRunner.update_stream`, then
:meth:`~megatrain_ray.engine.optim.AdamWRunner.update_master`): the first writes the moments and
the stream copy (24 bytes per parameter) and bumps the unit's stream version, which is all the
forward needs; once every unit has had it and the step's stats are out, the second writes the
master weights from the new moments (16 bytes per parameter) while the next step's forward and
backward run, and bumps the unit's state version (what checkpoints wait for, see
:class:`~megatrain_ray.engine.store.HostStore`). The same arithmetic, so the same bits; the next
step's gradients land in the stream blocks, which the second pass does not touch.

With several compute workers on the node, a unit is complete once every worker's ticket for it is
in: each for its shard of the all-reduced gradient, or (runtime.grad_reduce=host) for its own
whole gradient, which the sink then sums (:func:`~megatrain_ray.engine.grad_reduce.sum_copies`).
With a sharded optimizer across nodes (:mod:`megatrain_ray.engine.shards`) the updates also wait
for the last gradient, and the sink updates only its own units, receiving the others'.

Checkpoints (when given a :class:`~megatrain_ray.io.checkpoint.CheckpointPlan`) are started here, at
the top of the step loop, where every update of the previous step is done and none of this step's
has begun (a step boundary), and written in the background by a
:class:`~megatrain_ray.io.writer.CheckpointWriter` while the loop goes on: before each update the
sink waits only until that unit's bytes are written (usually long since). The last boundary is
saved after the loop, and waited for.
"""

from __future__ import annotations

import math
import queue
import time
from concurrent.futures import ThreadPoolExecutor

from ..config import OptimConfig, lr_at
from ..errors import PipelineError
from ..io.writer import CheckpointWriter
from . import affinity
from .grad_reduce import sum_copies
from .optim import AdamWRunner, clip_coefficient
from .shards import OptimizerShards
from .store import HostStore, StoreSpec
from .schedule import Schedule
from .tickets import NO_PROGRESS, GradTicket, wait_while_moving


class GradientSink:
    """Plain class; made a Ray actor (with several CPUs for the AdamW kernel) at spawn."""

    doing: tuple[int, int] | None = None
    """(step, unit) of the update being applied: what the dashboard shows (orchestration.labels)."""

    def __init__(self, spec: StoreSpec, optim: OptimConfig, total_steps: int, grad_q, stats_q,
                 timeout_s: float, num_threads: int = 1, checkpoint=None, grad_slot_q=None, shards: int = 1,
                 host_sum: bool = False, writes_checkpoints: bool = True, split_update: bool = True):
        self.runner = AdamWRunner(num_threads)
        self.store = HostStore(spec)
        self.layout = self.store.layout
        self.optim = optim
        self.total_steps = total_steps
        self.grad_q, self.stats_q = grad_q, stats_q
        self.timeout_s = timeout_s
        self.owned = spec.owned
        """Units the compute worker updates on its device (:mod:`megatrain_ray.engine.owned`): their
        tickets carry only their norms."""
        self.order = list(Schedule.build(self.layout, spec.model.tie_word_embeddings, spec.owned).sink_updates)
        self.spans: list[tuple] = []
        self.checkpoint = checkpoint
        self.writer = (CheckpointWriter(self.store, checkpoint)
                       if checkpoint is not None and writes_checkpoints else None)
        """Writes the plan's checkpoints; None without a plan, or on the other nodes of a sharded optimizer
        (``writes_checkpoints`` False: they only know the plan's boundaries, where they hand their AdamW
        states over, see :mod:`megatrain_ray.engine.shards`)."""
        self.sharding: OptimizerShards | None = None
        """This sink's part of the sharded optimizer (:meth:`join_shards`), or None: it updates every unit."""
        self.grad_slot_q = grad_slot_q
        self.shards = shards
        """Tickets per unit and step: one per compute worker of the node, each for its shard of the
        summed gradient (see :mod:`megatrain_ray.engine.grad_reduce`), or with ``host_sum`` for its
        whole gradient in a host copy of its own, which this sink sums (runtime.grad_reduce=host)."""
        self.host_sum = host_sum and shards > 1
        self.threads = max(1, num_threads)
        self.split_update = split_update
        """Run the deferred updates in two passes where they can (see the module docstring)."""
        self._sum_pool = ThreadPoolExecutor(self.threads, thread_name_prefix="grad-sum") if self.host_sum else None
        for slot in range(spec.grad_slots):  # the gradient ring starts empty: every slot is free
            grad_slot_q.put(slot, timeout=timeout_s)

    def run(self, start_step: int, end_step: int) -> int:
        """Apply the updates of steps [start_step, end_step); returns the number of steps done.

        After each step, puts {step, grad_norm, lr, update_busy_s, spans} on the stats queue; after
        each checkpoint, {checkpoint: path, step, save_s}.
        """
        for step in range(start_step, end_step):
            self._report_checkpoint()
            self._maybe_checkpoint(step, start_step, end_step)
            lr = lr_at(self.optim, step, self.total_steps)
            clip = self.optim.max_grad_norm > 0
            deferred = clip or self.sharding is not None  # updates after the last gradient, in update order
            split = False
            pending = dict.fromkeys(range(len(self.layout.units)), self.shards)
            sq_norm = 0.0
            while pending:
                ticket = self._get()
                if ticket.step != step or ticket.unit not in pending:
                    raise PipelineError(f"unexpected gradient of {self.layout.units[ticket.unit]} for step "
                                        f"{ticket.step} while collecting step {step}.")
                if not self.host_sum:
                    sq_norm += ticket.sq_norm
                pending[ticket.unit] -= 1
                if pending[ticket.unit]:
                    continue  # other workers' shards of this unit are still on their way
                del pending[ticket.unit]
                held = ticket.step_sq_norm != -1.0  # the step's norm is known already (gradients held on the device)
                if held and not math.isfinite(ticket.step_sq_norm):
                    self._diverged(step, math.sqrt(ticket.step_sq_norm))
                if ticket.unit in self.owned:
                    continue  # updated on the device
                if self.host_sum:
                    sq_norm += self._sum_copies(ticket.unit)
                if not deferred or held:  # (held gradients come from one worker alone: no sum, no shards)
                    coef = clip_coefficient(math.sqrt(ticket.step_sq_norm), self.optim.max_grad_norm) if held else 1.0
                    self._update(ticket.unit, step, lr, coef, ticket.slot)
                    if ticket.slot >= 0:
                        self.grad_slot_q.put(ticket.slot, timeout=self.timeout_s)
            norm = math.sqrt(ticket.step_sq_norm if held else sq_norm)
            if not math.isfinite(norm):
                self._diverged(step, norm)
            if deferred and not held:
                coef = clip_coefficient(norm, self.optim.max_grad_norm)
                split = self._splits()
                for unit in self.order:
                    if self.sharding is None or self.sharding.owns(unit):
                        self._update(unit, step, lr, coef, part="stream" if split else "whole")
                    if self.sharding is not None:
                        if self.writer is not None and not self.sharding.owns(unit):
                            self.writer.before_update(unit)  # the owner's weights land in this unit
                        self.sharding.share(unit, step + 1)
                if self.sharding is not None:
                    self.sharding.end_step()
            self.stats_q.put({"step": step, "grad_norm": norm, "lr": lr,
                              "update_busy_s": sum(e - b for _, _, b, e, _ in self.spans),
                              "spans": self.spans}, timeout=self.timeout_s)
            self.spans = []  # the second passes below are reported with the next step, as they run beside it
            if split:
                for unit in self.order:
                    self._update(unit, step, lr, coef, part="master")
        if self.sharding is not None:  # the export and any checkpoint after the run need every state
            self.sharding.gather_states(end_step, len(self.layout.units))
        self._maybe_checkpoint(end_step, start_step, end_step)
        self._report_checkpoint(wait=True)
        return end_step - start_step

    def _diverged(self, step: int, norm: float) -> None:
        """Finish the save being written (the last good weights: this step's update is never applied),
        then raise: the run stops, and its newest checkpoint is whole."""
        try:
            self._report_checkpoint(wait=True)
        except Exception:  # noqa: BLE001 (that save failed: the divergence is still what stops the run)
            pass
        raise PipelineError(f"the gradient norm of step {step + 1} is {norm}; training diverged, "
                            "lower optim.lr or check the data.")

    def rendezvous(self) -> tuple[str, int]:
        """(this node's IP, a free port on it): where the sinks' group meets (the first node's)."""
        import ray

        from .grad_reduce import free_port

        return ray.util.get_node_ip_address(), free_port()

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
            self.runner = AdamWRunner(threads)
        return affinity.pin_process(cpus)

    def _sum_copies(self, unit: int) -> float:
        """Sum the workers' host copies of ``unit``'s gradient into its grad block; its squared norm."""
        start = time.time()
        copies = [self.store.grad_block(unit, -1, k) for k in range(self.shards)]
        sq_norm = sum_copies(copies, self._sum_pool, self.threads)
        self.spans.append(("adamw", f"sum {self.layout.units[unit]}", start, time.time(), 0))
        return sq_norm

    def _maybe_checkpoint(self, step: int, start_step: int, end_step: int) -> None:
        """Start saving the boundary after ``step`` updates if the plan asks for it (see the module
        docstring); a save still being written is finished first."""
        if self.checkpoint is not None and self.checkpoint.due(step, start_step, end_step):
            self._report_checkpoint(wait=True)
            if self.sharding is not None:
                self.sharding.gather_states(step, len(self.layout.units))
            if self.writer is None:
                return
            self._await_owned(step)
            clip = self.optim.max_grad_norm > 0  # the order of this step's updates: see run()
            order = self.order if clip or self.sharding is not None else self.order[::-1]
            self.writer.start(step, [*self.owned, *order])  # the owned first: their copy is held until written

    def _await_owned(self, step: int) -> None:
        """Wait until the compute worker has copied the units it owns at boundary ``step`` into the
        store (it does right after their update, :meth:`~megatrain_ray.engine.owned.OwnedUnits.sync`)."""
        def copied(within: float) -> bool | None:
            return self.store.wait_until(lambda: all(self.store.state_version(u) == step for u in self.owned),
                                         within) or None

        if wait_while_moving(copied, self.grad_q, self.timeout_s) is None:
            names = ", ".join(self.layout.units[u] for u in self.owned)
            raise PipelineError(f"the gradient sink waited {self.timeout_s:.0f} s for the compute worker's copy of "
                                f"{names} at step {step} while no message moved between the roles; {NO_PROGRESS}")

    def _report_checkpoint(self, wait: bool = False) -> None:
        """Put the notice of a completed save on the stats queue ({checkpoint: path, step, save_s,
        stall_s}); raise its error if it failed. ``wait``: for the save being written."""
        if self.writer is not None:
            notice = self.writer.finish() if wait else self.writer.poll()
            if notice is not None:
                self.stats_q.put(notice, timeout=self.timeout_s)

    def _get(self) -> GradTicket:
        try:
            return wait_while_moving(lambda t: self.grad_q.get(timeout=t), self.grad_q, self.timeout_s)
        except queue.Empty:
            raise PipelineError(f"the gradient sink waited {self.timeout_s:.0f} s for a gradient while no message "
                                f"moved between the roles; {NO_PROGRESS}") from None

    def _splits(self) -> bool:
        """Whether the deferred updates run in two passes (``split_update``, the module docstring):
        one optimizer for the node's whole gradient (no shards, no host sum), fp32 master weights
        with a bf16 stream copy, the native kernel."""
        s = self.store
        if not (self.split_update and self.sharding is None and not self.host_sum and not s.spec.hold_grads
                and not s.spec.precision.compact and s.separate_stream_copy):
            return False
        return self.runner.splits(s.block("master", 0), s.grad_block(0), s.block("stream", 0))

    def _update(self, unit: int, step: int, lr: float, coef: float, slot: int = -1, part: str = "whole") -> None:
        """Apply step ``step``'s update to ``unit``: ``part`` whole, or its first (stream) or second
        (master) pass; then bump the versions that part completes."""
        self.doing = (step, unit)
        s = self.store
        if self.writer is not None:
            self.writer.before_update(unit)  # the checkpoint being written has this unit's bytes
        start = time.time()
        stream = s.block("stream", unit) if s.separate_stream_copy else None
        decay_numel = self.layout.templates[unit].decay_numel
        if part == "stream":
            self.runner.update_stream(s.block("master", unit), s.grad_block(unit), s.block("exp_avg", unit),
                                      s.block("exp_avg_sq", unit), stream, decay_numel, step + 1, lr, self.optim,
                                      grad_scale=coef)
        elif part == "master":
            self.runner.update_master(s.block("master", unit), s.block("exp_avg", unit), s.block("exp_avg_sq", unit),
                                      decay_numel, step + 1, lr, self.optim)
        elif s.spec.precision.compact:
            self.runner.update_compact(
                s.block("master", unit), s.grad_block(unit, slot), s.block("exp_avg", unit), s.block("exp_avg_sq", unit),
                s.scale_block("exp_avg_scale", unit), s.scale_block("exp_avg_sq_scale", unit), stream,
                decay_numel, unit, step + 1, lr, self.optim, grad_scale=coef)
        else:
            self.runner.update(s.block("master", unit), s.grad_block(unit, slot), s.block("exp_avg", unit),
                               s.block("exp_avg_sq", unit), stream, decay_numel, step + 1, lr, self.optim,
                               grad_scale=coef, unit=unit)
        {"whole": s.set_version, "stream": s.set_stream_version, "master": s.set_state_version}[part](unit, step + 1)
        name = self.layout.units[unit] + (" master" if part == "master" else "")
        self.spans.append(("adamw", name, start, time.time(), 0))
