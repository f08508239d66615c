"""Units resident on the compute worker's device (memory.resident): their weights and AdamW there.

At the step boundary the host pipeline has one wait it cannot reorder away: the clipping factor
needs every gradient, the embedding's comes last, and the next forward needs the embedding first,
so the GPU idles while the embedding's gradient goes to the host, the sink updates it and its new
weights come back (~0.15 s a step at the Qwen2.5-7B shape, plus ~0.05 s waiting on the head's
update at the end of the forward; benchmarks/results/2026-12-01_h200_defaults-7b/NOTES.md).

With memory.resident embed_head the compute worker holds the embedding and the head (``StoreSpec.resident``, see
:func:`~megatrain_ray.engine.store.host_store.resident_units`): their fp32 master weights and AdamW moments live
in its device memory for the whole attempt, with a compute-dtype copy of the weights that the
forward reads, so they are never fetched; their gradients stay on the device, and only a ticket
with the squared norm goes to the sink, which counts it in the step's norm and updates the rest.
At the end of the step's backward the worker updates them itself, with the factor the sink
computes (the same squared norms, summed in the same order), on the fp32 gradient as accumulated
(it never crosses to the host, so precision.grad_dtype does not round it): on the CPU backend through
the sink's own kernel (bit for bit the host update where the gradient dtype is fp32, as on the
CPU), on a GPU through ``torch._fused_adamw_`` in one call per span.

Their blocks in the host store are a copy, brought up to date (:meth:`ResidentUnits.sync`) only where
something reads them: at each checkpoint boundary, at the end of the run (the export), and on an
interrupt. A copy made for a checkpoint must stay until that checkpoint has written it, and the
worker may reach its next copy first (the sink starts a checkpoint only once it has updated the
steps before it, and may still be finishing the previous write; with a checkpoint every step the
worker is one boundary ahead by then). So the copy for a checkpoint sets the store's *checkpoint copy*
(:meth:`~megatrain_ray.engine.store.host_store.HostStore.set_checkpoint_copy`); the sink waits for the copy before
it starts that checkpoint, whose writer writes the resident units first and releases the copy once
their bytes are out; the next copy waits for the release.

A run with no unit resident holds the empty set, :class:`NoResidentUnits` (no units: nothing to
update at a step's end, nothing to copy), so the compute worker asks its resident units whether a
unit is one of them and never whether there are any.
"""

from __future__ import annotations

import math

import torch

from ...config import OptimConfig, lr_at
from ...errors import Diverged, PipelineError
from ..optim import AdamWRunner, adamw_unit, step_clipping

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
"""The store's kinds a resident unit keeps on the device (and copies back at a sync)."""


def checkpoint_due(checkpoints, step: int, start: int, end: int) -> bool:
    """Whether the sink checkpoints the boundary after step ``step`` (``checkpoints``: a
    :class:`~megatrain_ray.io.checkpoint.CheckpointSettings`, or None; steps [``start``, ``end``) of this
    attempt): the resident units' copy for it is held until its writer has it."""
    return checkpoints is not None and checkpoints.due(step + 1, start, end)


def sync_due(checkpoints, step: int, start: int, end: int) -> bool:
    """Whether the boundary after step ``step`` must find the resident units' state in the host store:
    a checkpoint's (:func:`checkpoint_due`) or the run's end (the export)."""
    return step + 1 == end or checkpoint_due(checkpoints, step, start, end)


def step_sq_norm(sq_norms: list[torch.Tensor]) -> float:
    """The step's squared gradient norm from each unit's (device scalars, in the order the units'
    tickets went to the sink), summed as the sink sums its tickets' floats: the same float."""
    total = 0.0
    for value in torch.stack(sq_norms).tolist():  # one copy to the host
        total += value
    return total


class DeviceAdamW:
    """The optimizer protocol (:mod:`megatrain_ray.engine.sink.updates`) on the device state of resident
    units: AdamW in one pass, through the sink's kernel on the CPU backend, else
    ``torch._fused_adamw_`` in one call per span."""

    def __init__(self, state: dict[int, dict[str, torch.Tensor]], runner: AdamWRunner | None, optim: OptimConfig,
                 total_steps: int, layout):
        self.state, self.runner, self.optim, self.total_steps, self.layout = state, runner, optim, total_steps, layout

    def update(self, unit: int, grad: torch.Tensor, coef: float, step: int) -> bool:
        s = self.state[unit]
        stream = None if s["weights"] is s["master"] else s["weights"]
        args = (s["master"], grad, s["exp_avg"], s["exp_avg_sq"], stream, self.layout.templates[unit].decay_numel,
                step + 1, lr_at(self.optim, step, self.total_steps), self.optim)
        if self.runner is not None:
            self.runner.update(*args, grad_scale=coef, unit=unit)
        else:
            adamw_unit(*args, grad_scale=coef, unit=unit, pieces=False)
        return True

    def finish(self, unit: int, step: int) -> None:
        pass


class ResidentUnits:
    """The device-resident weights and AdamW states of ``store.spec.resident`` (see the module docstring)."""

    def __init__(self, store, backend, optim: OptimConfig, total_steps: int, timeout_s: float,
                 threads: int = 1, registered: tuple[str, ...] = ()):
        """store: the worker's :class:`~megatrain_ray.engine.store.host_store.HostStore`; backend: its device
        backend; registered: the store's kinds whose whole arrays the backend has pinned already
        (the resident blocks of the others are pinned here, for full-speed copies)."""
        self.store, self.backend = store, backend
        self.units = store.spec.resident
        self.names = {u: store.layout.units[u] for u in self.units}
        self.optim, self.total_steps, self.timeout_s = optim, total_steps, timeout_s
        self.compute_dtype = store.spec.precision.compute
        self.runner = AdamWRunner(threads) if backend.device.type == "cpu" else None
        """The sink's kernel on the CPU backend (the same bits as a host update); None on a GPU."""
        self.state: dict[int, dict[str, torch.Tensor]] = {}
        """unit -> master, exp_avg, exp_avg_sq ([numel] fp32 on the device) and weights (the master in
        the compute dtype; the master itself when that is fp32)."""
        self.version: int | None = None
        """Updates the device state has received; None until the first step loads it."""
        self.optimizer = DeviceAdamW(self.state, self.runner, optim, total_steps, store.layout)
        self.grads: dict[int, torch.Tensor] = {}
        """unit -> this step's gradient [numel] fp32 on the device, until the update."""
        self.diverged: str | None = None
        """The sink's words for a step whose gradient norm was not finite (no update was applied): the
        next step waits, as for weights that never come, and then says them."""
        for kind in STATE_KINDS:
            if kind not in registered:
                for u in self.units:
                    backend.register_host(store.block(kind, u))

    def weights(self, unit: int, step: int) -> torch.Tensor | None:
        """``unit``'s weights [numel] in the compute dtype for step ``step`` (at its first call, the
        state is taken from the host store, which must be at that boundary); None after a step whose
        gradient norm was not finite (``diverged``): there are none, as there are no new weights
        to fetch for the others."""
        if self.version is None:
            self._load(step)
        if self.diverged is not None:
            return None
        if self.version != step:
            raise PipelineError(f"{self.names[unit]} on the device has {self.version} updates but step {step} "
                                f"needs {step}.")
        return self.state[unit]["weights"]

    def _load(self, step: int) -> None:
        dev = self.backend.device
        for u in self.units:
            at = (self.store.version(u), self.store.state_version(u))
            if at != (step, step):
                raise PipelineError(f"{self.names[u]} is at versions {at} in the host store, but step {step} "
                                    f"starts from {step}.")
            state = {kind: self.store.block(kind, u).to(dev, copy=True) for kind in STATE_KINDS}
            master = state["master"]
            state["weights"] = master if self.compute_dtype == master.dtype else master.to(self.compute_dtype)
            self.state[u] = state
        self.version = step

    def take_grad(self, unit: int, grad: torch.Tensor) -> None:
        """Keep ``unit``'s gradient of this step (grad: [numel] fp32 on the device) for :meth:`update`."""
        self.grads[unit] = grad

    def update(self, step: int, sq_norm: float) -> bool:
        """Apply step ``step``'s AdamW update to every resident unit, clipped by the step's squared
        gradient norm ``sq_norm`` (:func:`step_sq_norm`); False, and nothing applied, when it is not
        finite (the sink stops the run on it; so does the next step here, in the sink's words)."""
        grads, self.grads = self.grads, {}
        try:
            coef = step_clipping(step, math.sqrt(sq_norm), self.optim.max_grad_norm)
        except Diverged as error:
            self.diverged = str(error)
            return False
        for u in self.units:
            self.optimizer.update(u, grads.pop(u), coef, step)  # the gradient: fp32, scaled in place
        self.version = step + 1
        return True

    def end_step(self, step: int, sq_norms: list[torch.Tensor], sync: bool, for_checkpoint: bool) -> None:
        """At the end of step ``step``'s backward: :meth:`update`, clipped by the squared norm summed from
        every unit's ``sq_norms`` (:func:`step_sq_norm`), then with ``sync`` :meth:`sync` (``for_checkpoint``:
        a checkpoint's copy; see :func:`sync_due`)."""
        with self.backend.compute("adamw (resident units)"):
            self.update(step, step_sq_norm(sq_norms))
        if sync:
            self.sync(for_checkpoint)

    def sync(self, for_checkpoint: bool = False) -> None:
        """Copy the device state into the resident units' host blocks and mark them at its version, once
        no checkpoint needs the previous copy (the checkpoint copy); ``for_checkpoint``: this copy is a checkpoint's
        (:func:`checkpoint_due`), kept until its writer releases it. Nothing before the first step has
        loaded the state (the host store's blocks are the state then)."""
        if self.version is None:
            return
        if not self.store.wait_until(lambda: self.store.checkpoint_copy() is None, self.timeout_s, pause=0.005):
            raise PipelineError(f"the compute worker waited {self.timeout_s:.0f} s for the checkpoint of step "
                                f"{self.store.checkpoint_copy()} to write {', '.join(self.names.values())}: the gradient "
                                "sink or the checkpoint writer is stalled (a slow disk?); raise "
                                "cluster.actor_timeout_s if it is just slow.")
        done = None
        for u in self.units:
            for kind in STATE_KINDS:
                done = self.backend.stash(self.state[u][kind], self.store.block(kind, u), f"{self.names[u]} {kind}")
        self.backend.host_wait(done)
        if for_checkpoint:
            self.store.set_checkpoint_copy(self.version)
        for u in self.units:
            self.store.set_version(u, self.version)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


class NoResidentUnits:
    """The resident units of a run with none (memory.resident none): an empty set."""

    units: tuple[int, ...] = ()
    """No unit is resident: :meth:`ResidentUnits.weights` is never asked for one."""

    def end_step(self, step: int, sq_norms: list[torch.Tensor], sync: bool, for_checkpoint: bool) -> None:
        pass

    def sync(self, for_checkpoint: bool = False) -> None:
        pass

    def close(self) -> None:
        pass
