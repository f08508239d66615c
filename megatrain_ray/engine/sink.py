"""The gradient sink: AdamW on the CPU, one unit at a time, as gradients arrive.

One loop over the run: for every step, take :class:`~megatrain_ray.engine.tickets.GradTicket` s from the
grad queue (each names a unit whose gradient is complete in its host grad block, and carries its
squared norm, taken on the device) and add them up. Without clipping each unit is updated the moment its
gradient arrives (and, when the store keeps the gradients in a ring of slots, the slot is handed
back to the compute worker right after). With clipping the factor needs the global norm, so the updates run once the last
gradient (the embedding's) is in, in the order the next step's forward needs them — embedding,
layer 0, 1, ... — so the next forward can start on layer 0 while later layers are still updating.
After a unit's update its stream copy is refreshed and only then its version bumped, which is what
lets the prefetcher stream it for the next step.

Checkpoints (when given a :class:`~megatrain_ray.io.checkpoint.CheckpointPlan`) are written here, at
the top of the step loop: every update of the previous step is done and none of this step's has
begun, so the store is at a step boundary; this step's gradients queue up in the grad queue
meanwhile and the compute worker runs on. The last boundary is saved after the loop.
"""

from __future__ import annotations

import math
import queue
import time

from ..config import OptimConfig, lr_at
from ..errors import PipelineError
from .optim import AdamWRunner, clip_coefficient
from .store import HostStore, StoreSpec
from .tickets import GradTicket, update_order


class GradientSink:
    """Plain class; made a Ray actor (with several CPUs for the AdamW kernel) at spawn."""

    doing: tuple[int, int] | None = None
    """(step, unit) of the update being applied: what the dashboard shows (orchestration.labels)."""

    def __init__(self, spec: StoreSpec, optim: OptimConfig, total_steps: int, grad_q, stats_q,
                 timeout_s: float, num_threads: int = 1, checkpoint=None, grad_slot_q=None, shards: int = 1):
        self.runner = AdamWRunner(num_threads)
        self.store = HostStore(spec)
        self.layout = self.store.layout
        self.optim = optim
        self.total_steps = total_steps
        self.grad_q, self.stats_q = grad_q, stats_q
        self.timeout_s = timeout_s
        self.order = update_order(spec.model.num_hidden_layers)
        self.spans: list[tuple] = []
        self.checkpoint = checkpoint
        self.grad_slot_q = grad_slot_q
        self.shards = shards
        """Tickets per unit and step: one per compute worker of the node, each for its shard of the
        summed gradient (see :mod:`megatrain_ray.engine.grad_reduce`)."""
        for slot in range(spec.grad_slots):  # the gradient ring starts empty: every slot is free
            grad_slot_q.put(slot, timeout=timeout_s)

    def run(self, start_step: int, end_step: int) -> int:
        """Apply the updates of steps [start_step, end_step); returns the number of steps done.

        After each step, puts {step, grad_norm, lr, update_busy_s, spans} on the stats queue; after
        each checkpoint, {checkpoint: path, step, save_s}.
        """
        for step in range(start_step, end_step):
            self._maybe_checkpoint(step, start_step, end_step)
            self.spans = []
            lr = lr_at(self.optim, step, self.total_steps)
            clip = self.optim.max_grad_norm > 0
            pending = dict.fromkeys(range(len(self.layout.units)), self.shards)
            sq_norm = 0.0
            while pending:
                ticket = self._get()
                if ticket.step != step or ticket.unit not in pending:
                    raise PipelineError(f"unexpected gradient of {self.layout.units[ticket.unit]} for step "
                                        f"{ticket.step} while collecting step {step}.")
                sq_norm += ticket.sq_norm
                pending[ticket.unit] -= 1
                if pending[ticket.unit]:
                    continue  # other workers' shards of this unit are still on their way
                del pending[ticket.unit]
                if not clip:
                    self._update(ticket.unit, step, lr, 1.0, ticket.slot)
                    if ticket.slot >= 0:
                        self.grad_slot_q.put(ticket.slot, timeout=self.timeout_s)
            norm = math.sqrt(sq_norm)
            if not math.isfinite(norm):
                raise PipelineError(f"the gradient norm of step {step + 1} is {norm}; training diverged, "
                                    "lower optim.lr or check the data.")
            if clip:
                coef = clip_coefficient(norm, self.optim.max_grad_norm)
                for unit in self.order:
                    self._update(unit, step, lr, coef)
            self.stats_q.put({"step": step, "grad_norm": norm, "lr": lr,
                              "update_busy_s": sum(e - b for _, _, b, e, _ in self.spans),
                              "spans": self.spans}, timeout=self.timeout_s)
        self._maybe_checkpoint(end_step, start_step, end_step)
        return end_step - start_step

    def close(self) -> None:
        """Stop the AdamW thread pool (an actor's process ends with it anyway)."""
        self.runner.close()

    def _maybe_checkpoint(self, step: int, start_step: int, end_step: int) -> None:
        """Save the boundary after ``step`` updates if the plan asks for it (see the module docstring)."""
        if self.checkpoint is not None and self.checkpoint.due(step, start_step, end_step):
            start = time.time()
            path = self.checkpoint.save(self.store, step)
            self.stats_q.put({"checkpoint": path, "step": step, "save_s": time.time() - start},
                             timeout=self.timeout_s)

    def _get(self) -> GradTicket:
        try:
            return self.grad_q.get(timeout=self.timeout_s)
        except queue.Empty:
            raise PipelineError(f"the gradient sink waited {self.timeout_s:.0f} s for a gradient: "
                                "the compute worker is stalled.") from None

    def _update(self, unit: int, step: int, lr: float, coef: float, slot: int = -1) -> None:
        self.doing = (step, unit)
        s = self.store
        start = time.time()
        stream = s.block("stream", unit) if s.separate_stream_copy else None
        self.runner.update(s.block("master", unit), s.grad_block(unit, slot), s.block("exp_avg", unit),
                           s.block("exp_avg_sq", unit), stream, self.layout.templates[unit].decay_numel,
                           step + 1, lr, self.optim, grad_scale=coef)
        s.set_version(unit, step + 1)
        self.spans.append(("adamw", self.layout.units[unit], start, time.time(), 0))
