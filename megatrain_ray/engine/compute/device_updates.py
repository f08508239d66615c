"""Streamed units updated on the compute worker's device (optim.placement device).

A streamed unit whose policy is :data:`~megatrain_ray.engine.policy.STREAMED_ON_DEVICE` is fetched as
any streamed unit, but its gradient does not cross to the host: its whole fp32 gradient, as the
step's micro-batches accumulated it, stays on the device, and only its squared norm goes to the
gradient sink, which counts it in the step's norm as it counts every ticket's. At the end of the
step's backward, once the step's norm is known here (the same squared norms summed in the same
order as the sink sums its tickets', :func:`~megatrain_ray.engine.compute.resident.step_sq_norm`),
each such unit, in update order, piece by piece (:data:`PIECE` elements at a time, so the device
holds one piece's state, never a whole unit's), has its fp32 master weights and AdamW moments
copied in from the host store, updated by the arithmetic of the resident units' update (on the CPU
backend the sink's own kernel, :class:`~megatrain_ray.engine.optim.AdamWRunner`, so bit for bit the
host update where the gradient dtype is fp32: the update is elementwise, so its pieces do not
change its bits; on a GPU ``torch._fused_adamw_``, :func:`~megatrain_ray.engine.optim.adamw_unit`),
each piece's decay span as the unit's, and written back (with the stream copy, where the store keeps
one); then its versions say ``step + 1`` and the prefetcher may stream it for the next step. So the host
store holds each such unit's state at every step boundary (checkpoints, the export and an interrupt
find it there), and the host's CPUs update nothing of it.

A checkpoint reads the host store while the next step runs: before its first write-back the worker
waits until no checkpoint of an earlier boundary still holds the copy (the store's *checkpoint copy*,
the handshake of the resident units' sync, :mod:`megatrain_ray.engine.compute.resident`), and after
the writes of a checkpoint's boundary it holds the copy for that checkpoint itself; the sink's
writer writes these units first and releases it.

A step whose gradient norm is not finite applies nothing: the sink stops the run on it
(:func:`~megatrain_ray.engine.optim.step_clipping`), and these units stay at the versions the
prefetcher then waits on.

A run without such units holds the empty set, :class:`NoStreamedUpdates`.
"""

from __future__ import annotations

import math

import torch

from ...config import OptimConfig, lr_at
from ...errors import Diverged, PipelineError
from ..optim import AdamWRunner, adamw_unit, step_clipping
from .resident import STATE_KINDS, step_sq_norm

PIECE = 1 << 26
"""Elements of a unit's state on the device at a time (256 MiB per fp32 kind): what the plan counts
for the update beside the held gradients."""


class StreamedUpdates:
    """The device updates of streamed units (see the module docstring)."""

    def __init__(self, store, backend, units: tuple[int, ...], optim: OptimConfig, total_steps: int,
                 timeout_s: float, threads: int = 1, registered: tuple[str, ...] = ()):
        """store: the worker's :class:`~megatrain_ray.engine.store.host_store.HostStore`; backend: its
        device backend; units: those updated here, in update order; registered: the store's kinds whose
        arrays the backend has pinned already (the units' blocks of the others are pinned here, for
        full-speed copies)."""
        self.store, self.backend, self.units = store, backend, units
        self.names = {u: store.layout.units[u] for u in units}
        self.optim, self.total_steps, self.timeout_s = optim, total_steps, timeout_s
        self.runner = AdamWRunner(threads) if backend.device.type == "cpu" else None
        """The sink's kernel on the CPU backend (the same bits as a host update); None on a GPU."""
        self.grads: dict[int, torch.Tensor] = {}
        """unit -> this step's gradient [numel] fp32 on the device, until the update."""
        for kind in STATE_KINDS:
            if kind not in registered:
                for u in units:
                    backend.register_host(store.block(kind, u))

    def take_grad(self, unit: int, grad: torch.Tensor) -> None:
        """Keep ``unit``'s gradient of this step (grad: [numel] fp32 on the device) for :meth:`end_step`."""
        self.grads[unit] = grad

    def end_step(self, step: int, sq_norms: list[torch.Tensor], sync: bool, for_checkpoint: bool) -> None:
        """Update every unit of step ``step``, clipped by the step's norm from every unit's squared norm
        ``sq_norms``, writing each back to the host store; ``for_checkpoint``: the boundary after it is a
        checkpoint's, which holds the copy (``sync``: the resident units' concern, every update is written)."""
        grads, self.grads = self.grads, {}
        try:
            coef = step_clipping(step, math.sqrt(step_sq_norm(sq_norms)), self.optim.max_grad_norm)
        except Diverged:
            return  # nothing applied: the sink stops the run on the same norm
        self._await_copy(step + 1)
        for u in self.units:
            self._update(u, grads.pop(u), coef, step)
        if for_checkpoint:
            self.store.set_checkpoint_copy(step + 1)

    def _update(self, unit: int, grad: torch.Tensor, coef: float, step: int) -> None:
        """One unit, piece by piece: its state in, AdamW, its state (and stream copy) back to the host
        store; then its versions. grad: [numel] fp32 on the device."""
        name, store = self.names[unit], self.store
        numel, decay = grad.numel(), store.layout.templates[unit].decay_numel
        done = None
        for a in range(0, numel, PIECE):
            b = min(numel, a + PIECE)
            with self.backend.compute(f"adamw {name}"):
                state = {kind: store.block(kind, unit)[a:b].to(self.backend.device, copy=True) for kind in STATE_KINDS}
                stream = (torch.empty(b - a, dtype=store.spec.precision.compute, device=self.backend.device)
                          if store.separate_stream_copy else None)
                args = (state["master"], grad[a:b], state["exp_avg"], state["exp_avg_sq"], stream,
                        min(max(decay - a, 0), b - a), step + 1, lr_at(self.optim, step, self.total_steps), self.optim)
                if self.runner is not None:  # the gradient: fp32, scaled in place
                    self.runner.update(*args, grad_scale=coef, unit=unit)
                else:
                    adamw_unit(*args, grad_scale=coef, unit=unit, pieces=False)
            for kind in STATE_KINDS:
                done = self.backend.stash(state[kind], store.block(kind, unit)[a:b], f"{name} {kind}")
            if stream is not None:
                done = self.backend.stash(stream, store.block("stream", unit)[a:b], f"{name} stream")
        self.backend.host_wait(done)
        store.set_version(unit, step + 1)

    def _await_copy(self, boundary: int) -> None:
        """Wait until no checkpoint of a boundary before ``boundary`` holds the host copy."""
        store = self.store
        if not store.wait_until(lambda: store.checkpoint_copy() in (None, boundary), self.timeout_s, pause=0.005):
            raise PipelineError(f"the compute worker waited {self.timeout_s:.0f} s for the checkpoint of step "
                                f"{store.checkpoint_copy()} to write the units it updates: the gradient sink or the "
                                "checkpoint writer is stalled (a slow disk?); raise cluster.actor_timeout_s if it is "
                                "just slow.")

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


class NoStreamedUpdates:
    """A run whose streamed units are all updated by the gradient sink: an empty set."""

    units: tuple[int, ...] = ()

    def end_step(self, step: int, sq_norms: list[torch.Tensor], sync: bool, for_checkpoint: bool) -> None:
        pass

    def close(self) -> None:
        pass
