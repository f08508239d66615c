"""Streamed units updated on the compute worker's device (optim.placement device).

A streamed unit whose policy is :data:`~megatrain_ray.engine.policy.STREAMED_ON_DEVICE` is fetched as
any streamed unit, but its gradient does not cross to the host: its whole fp32 gradient, as the
step's micro-batches accumulated it, stays on the device, and only its squared norm goes to the
gradient sink, which counts it in the step's norm as it counts every ticket's. At the end of the
step's backward, once the step's norm is known here (the same squared norms summed in the same
order as the sink sums its tickets', :func:`~megatrain_ray.engine.compute.resident.step_sq_norm`),
each such unit, in update order, piece by piece (:data:`PIECE` elements at a time, so the device
holds a few pieces' state, never a whole unit's, and a piece comes in while the one before is
updated and the one before that goes out), has its fp32 master weights and AdamW moments
copied in from the host store, updated by the arithmetic of the resident units' update (on the CPU
backend the sink's own kernel, :class:`~megatrain_ray.engine.optim.AdamWRunner`, so bit for bit the
host update where the gradient dtype is fp32: the update is elementwise, so its pieces do not
change its bits; on a GPU ``torch._fused_adamw_``, :func:`~megatrain_ray.engine.optim.adamw_unit`),
each piece's decay span as the unit's, and written back (with the stream copy, where the store keeps
one); then its versions say ``step + 1`` and the prefetcher may stream it for the next step.

These updates run on a thread of their own (``device-updates``), on a device stream of their own
(the backend's ``beside`` the compute, :mod:`~megatrain_ray.engine.compute.device`, after the step's
last gradient), into three buffers made once (:attr:`StreamedUpdates.ring`), so the compute thread
goes on to the next step's forward at once: the units that forward needs first, once the prefetcher
has them at ``step + 1``, while the updates of the later ones run beside it. The plan puts the
device's units first in the forward's order (:mod:`megatrain_ray.orchestration.placement`), so
their updates lead the forward and the host's, last, have the most time. The next step's end waits
for the thread (done by then: its forward had every unit), and so does a step whose boundary is a
checkpoint's or the run's end (``sync``), before the step returns. A failure of the thread stops
the compute thread at its next wait for weights, with the thread's error. With
the 8-bit state (optim.state 8bit) the pieces are its bf16 master weights, the two uint8 codes and
their fp32 block scales (whole blocks: a piece starts on a block boundary), updated on a GPU by
one fused kernel (:mod:`~megatrain_ray.engine.compact_fused`) where Triton is installed, else by
:func:`~megatrain_ray.engine.compact.step_reference`, :data:`COMPACT_CHUNK` elements at a time: the
torch form of the sink's compact kernel; the same bits either way. The
span from the first copy in to the last copy out is the step's ``device_update`` interval (the
step metrics' ``device_update_busy_s``, beside the sink's ``update_busy_s``). So the host
store holds each such unit's state at every boundary once its versions say so (a checkpoint, the
export and an interrupt wait for them), and the host's CPUs update nothing of it.

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
import threading
import time
from typing import Callable

import torch

from ...config import OptimConfig, lr_at
from ...errors import Diverged, PipelineError, thread_failed
from .. import compact, compact_fused
from ..optim import AdamWRunner, adamw_unit, step_clipping
from ..store.host_store import SCALE_KINDS
from .resident import STATE_KINDS, step_sq_norm

PIECE = 1 << 26
"""Elements of a piece of a unit's state on the device (256 MiB per fp32 kind); up to three pieces
are on the device at once (one coming in, one updated, one going out): what the plan counts for the
update beside the held gradients."""
IN_FLIGHT = 3
"""Pieces of state on the device at once (see :data:`PIECE`)."""
COMPACT_CHUNK = 1 << 24
"""Elements the compact state's update (:func:`~megatrain_ray.engine.compact.step_reference`) takes at once
on the device: its temporaries (fp32 values, int64 random words and bit patterns) stay ~2 GiB."""
COMPACT_WORK_BYTES = 128
"""Bytes per element of :data:`COMPACT_CHUNK` that the compact update's temporaries take at their peak
(measured on the CPU: 123 at 8 M elements, the peak resident set's growth over one call)."""


def state_bytes(compact_state: bool, stream: int) -> tuple[float, float]:
    """(bytes in, bytes out) per parameter of a unit updated on the device: fp32 master weights and
    moments, or the compact state's bf16 master weights, two uint8 codes and their fp32 block scales;
    out with a ``stream``-byte stream copy where the store keeps one (not on a GPU with the compact
    state: its bf16 master weights are the copy streamed)."""
    state = 2 + 1 + 1 + 2 * 4 / compact.BLOCK if compact_state else 12
    return state, state + stream


class StreamedUpdates:
    """The device updates of streamed units (see the module docstring)."""

    def __init__(self, store, backend, units: tuple[int, ...], optim: OptimConfig, total_steps: int,
                 timeout_s: float, threads: int = 1, registered: tuple[str, ...] = (),
                 failed: Callable[[BaseException], None] = lambda e: None):
        """store: the worker's :class:`~megatrain_ray.engine.store.host_store.HostStore`; backend: its
        device backend; units: those updated here, in update order; registered: the store's kinds whose
        arrays the backend has pinned already (the units' blocks of the others are pinned here, for
        full-speed copies); failed: told what the updater thread failed with, as it fails."""
        self.store, self.backend, self.units = store, backend, units
        self.names = {u: store.layout.units[u] for u in units}
        self.optim, self.total_steps, self.timeout_s = optim, total_steps, timeout_s
        self.compact = store.spec.precision.compact
        """The 8-bit state (optim.state 8bit): bf16 master weights, uint8 codes and their block scales,
        updated bit for bit as the sink's kernel (:attr:`fused`); else fp32 state."""
        self.fused = self.compact and compact_fused.available(backend.device)
        """The compact state's update as one fused kernel on the GPU (:mod:`~megatrain_ray.engine.compact_fused`,
        the same bits), else :func:`~megatrain_ray.engine.compact.step_reference`."""
        self.runner = AdamWRunner(threads) if backend.device.type == "cpu" and not self.compact else None
        """The sink's exact kernel on the CPU backend (the same bits as a host update); None on a GPU."""
        self.grads: dict[int, torch.Tensor] = {}
        """unit -> this step's gradient [numel] fp32 on the device, until the update."""
        self.failed = failed
        self._thread: threading.Thread | None = None
        """The updater thread of the last step's updates, until :meth:`join`."""
        self.error: BaseException | None = None
        """What the updater thread failed with, until :meth:`join` raises it."""
        for kind in STATE_KINDS + (SCALE_KINDS if self.compact else ()):
            if kind not in registered:
                for u in units:
                    backend.register_host(self._host(kind, u))
        self.ring = [self._buffers() for _ in range(IN_FLIGHT)]
        """The device buffers of the pieces under way (kind -> [PIECE] or its block scales), made once
        here, while the device is empty: an update beside the next forward allocates nothing (device
        memory the allocator would have to find, or free for, while the compute allocates too)."""
        self._reusable: list[object] = [backend.mark() for _ in range(IN_FLIGHT)]
        """Each ring slot's last copy out (its buffers may be overwritten once it is done)."""

    def _buffers(self) -> dict[str, torch.Tensor]:
        """One ring slot: a piece's device buffer for each kind of the state."""
        n = min(PIECE, max(self.store.layout.templates[u].numel for u in self.units))
        sizes = {kind: n for kind in STATE_KINDS}
        if self.compact:
            sizes.update({kind: compact.num_blocks(n) for kind in SCALE_KINDS})
        return {kind: torch.empty(size, dtype=self._host(kind, self.units[0]).dtype, device=self.backend.device)
                for kind, size in sizes.items()}

    def take_grad(self, unit: int, grad: torch.Tensor) -> None:
        """Keep ``unit``'s gradient of this step (grad: [numel] fp32 on the device) for :meth:`end_step`."""
        self.grads[unit] = grad

    def end_step(self, step: int, sq_norms: list[torch.Tensor], sync: bool, for_checkpoint: bool) -> None:
        """Start the update of every unit of step ``step``, clipped by the step's norm from every unit's
        squared norm ``sq_norms``, writing each back to the host store, on the updater thread beside the
        next step (see the module docstring); ``sync``: the boundary after it is a checkpoint's (then
        ``for_checkpoint``: it holds the copy) or the run's end, so the updates are done on return."""
        self.join()  # the step before's: done once the forward had every unit, so at once
        grads, self.grads = self.grads, {}
        try:
            coef = step_clipping(step, math.sqrt(step_sq_norm(sq_norms)), self.optim.max_grad_norm)
        except Diverged:
            return  # nothing applied: the sink stops the run on the same norm
        computed = self.backend.mark()  # the step's gradients are complete on the compute stream there
        self._thread = threading.Thread(target=self._run, args=(step, grads, coef, for_checkpoint, computed),
                                        daemon=True, name="device-updates")
        self._thread.start()
        if sync:
            self.join()

    def join(self) -> None:
        """Wait for the updates under way (none: at once); raise what they failed with."""
        self._wait()
        if self.error is not None:
            error, self.error = self.error, None
            raise thread_failed(error, "the compute worker's device-updates thread", "updating the streamed units")

    def _wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self, step: int, grads: dict[int, torch.Tensor], coef: float, for_checkpoint: bool, computed) -> None:
        """The updater thread's work for step ``step`` (see :meth:`end_step`); a failure is kept for
        :meth:`join` and handed to ``failed`` at once (the compute thread waits on versions it would set)."""
        try:
            began = time.time()
            self._await_copy(step + 1)
            with self.backend.beside(computed, tuple(grads.values())):
                self._update_all(grads, coef, step)
            self.backend.note("device_update", "adamw of the streamed units", began, time.time())
            if for_checkpoint:
                self.store.set_checkpoint_copy(step + 1)
        except BaseException as e:  # noqa: BLE001 (raised by join, and by the compute thread through failed)
            self.error = e
            self.failed(e)

    def _update_all(self, grads: dict[int, torch.Tensor], coef: float, step: int) -> None:
        """Every unit, piece by piece, as a pipeline on the device's streams: the next piece's state
        comes in (the copy-in stream) while this one is updated (the thread's current stream) and the one before
        goes out (the copy-out stream); a unit's versions move once its last piece is out, while the
        next unit's pieces are under way. grads: unit -> [numel] fp32 on the device."""
        store, lr = self.store, lr_at(self.optim, step, self.total_steps)
        pieces = [(u, a, min(grads[u].numel(), a + PIECE))
                  for u in self.units for a in range(0, grads[u].numel(), PIECE)]
        ahead = self._load(*pieces[0], 0) if pieces else {}
        written: tuple[int, object] | None = None  # (unit, its last copy-out) not yet waited for
        for i, (unit, a, b) in enumerate(pieces):
            state, ahead = ahead, self._load(*pieces[i + 1], (i + 1) % IN_FLIGHT) if i + 1 < len(pieces) else {}
            for _, ready in state.values():
                self.backend.wait(ready)
            values = {kind: value for kind, (value, _) in state.items()}
            decay = min(max(store.layout.templates[unit].decay_numel - a, 0), b - a)
            if self.compact:
                self._update_compact(values, grads[unit][a:b], unit, a, decay, coef, step, lr)
                values["stream"] = (values["master"].to(store.spec.precision.compute)
                                    if store.separate_stream_copy else None)
            else:
                values["stream"] = self._update_exact(values, grads[unit][a:b], unit, decay, coef, step, lr)
            done = None
            for kind, value in values.items():
                if value is not None:
                    done = self.backend.stash(value, self._host(kind, unit, a, b), f"{self.names[unit]} {kind} out")
            self._reusable[i % IN_FLIGHT] = done  # the copy-out stream's last: its slot's copies are all out then
            if b == grads[unit].numel():  # the unit's last piece: its gradient is read; the one before may move on
                del grads[unit]
                self._written(written, step)
                written = (unit, done)
        self._written(written, step)

    def _update_exact(self, state: dict[str, torch.Tensor], grad: torch.Tensor, unit: int, decay: int, coef: float,
                      step: int, lr: float) -> torch.Tensor | None:
        """AdamW on one piece of fp32 state (kind -> [n] on the device), in place; returns the piece's new
        stream copy (None where the store keeps none). grad: [n] fp32, scaled in place."""
        stream = (torch.empty(grad.numel(), dtype=self.store.spec.precision.compute, device=self.backend.device)
                  if self.store.separate_stream_copy else None)
        args = (state["master"], grad, state["exp_avg"], state["exp_avg_sq"], stream, decay, step + 1, lr, self.optim)
        if self.runner is not None:
            self.runner.update(*args, grad_scale=coef, unit=unit)
        else:
            adamw_unit(*args, grad_scale=coef, unit=unit, pieces=False)
        return stream

    def _update_compact(self, state: dict[str, torch.Tensor], grad: torch.Tensor, unit: int, a: int, decay: int,
                        coef: float, step: int, lr: float) -> None:
        """The compact AdamW step on one piece (kind -> [n] or its block scales, on the device; ``a``: the
        piece's first element in the unit, a block boundary), in place: by the fused kernel (:attr:`fused`),
        else :data:`COMPACT_CHUNK` elements at a time; the sink's arithmetic
        (:meth:`~megatrain_ray.engine.optim.AdamWRunner.update_compact`)."""
        o = self.optim
        rest = o.weight_decay if o.decay_norms_and_biases else 0.0
        c = compact.StepConstants.of(step + 1, lr, o.beta1, o.beta2, o.eps, o.weight_decay, rest, coef)
        key = compact.rng_key(step + 1, unit)
        if self.fused:
            compact_fused.step(state["master"], grad, state["exp_avg"], state["exp_avg_sq"], state["exp_avg_scale"],
                               state["exp_avg_sq_scale"], decay, c, key, a)
            return
        for lo in range(0, grad.numel(), COMPACT_CHUNK):
            hi = min(grad.numel(), lo + COMPACT_CHUNK)
            blocks = slice(lo // compact.BLOCK, compact.num_blocks(hi))
            compact.step_reference(state["master"][lo:hi], grad[lo:hi], state["exp_avg"][lo:hi],
                                   state["exp_avg_sq"][lo:hi], state["exp_avg_scale"][blocks],
                                   state["exp_avg_sq_scale"][blocks], decay - lo, c, key, a + lo)

    def _host(self, kind: str, unit: int, a: int = 0, b: int | None = None) -> torch.Tensor:
        """The host store's block of ``kind`` for ``unit``'s elements [a, b) (a scale kind: the blocks that
        hold them)."""
        if kind in SCALE_KINDS:
            block = self.store.scale_block(kind, unit)
            return block[a // compact.BLOCK:None if b is None else compact.num_blocks(b)]
        return self.store.block(kind, unit)[a:b]

    def _load(self, unit: int, a: int, b: int, slot: int) -> dict[str, tuple[torch.Tensor, object]]:
        """Start the copy of ``unit``'s state [a, b) into ring slot ``slot``, once that slot's last copy
        out is done: kind -> (tensor, its ready handle)."""
        kinds = STATE_KINDS + (SCALE_KINDS if self.compact else ())
        loads = {}
        for kind in kinds:
            host = self._host(kind, unit, a, b)
            loads[kind] = self.backend.unstash(host, self._reusable[slot], f"{self.names[unit]} {kind} in",
                                               self.ring[slot][kind][:host.numel()])
        return loads

    def _written(self, written: tuple[int, object] | None, step: int) -> None:
        """Once a unit's last copy-out is complete, it is at ``step + 1`` updates (its state, then its
        stream copy: what the prefetcher waits for)."""
        if written is not None:
            self.backend.host_wait(written[1])
            self.store.set_version(written[0], step + 1)

    def _await_copy(self, boundary: int) -> None:
        """Wait until no checkpoint of a boundary before ``boundary`` holds the host copy."""
        store = self.store
        if not store.wait_until(lambda: store.checkpoint_copy() in (None, boundary), self.timeout_s, pause=0.005):
            raise PipelineError(f"the compute worker waited {self.timeout_s:.0f} s for the checkpoint of step "
                                f"{store.checkpoint_copy()} to write the units it updates: the gradient sink or the "
                                "checkpoint writer is stalled (a slow disk?); raise cluster.actor_timeout_s if it is "
                                "just slow.")

    def close(self) -> None:
        """Wait for the updates under way (what they failed with went to ``failed`` already)."""
        self._wait()
        if self.runner is not None:
            self.runner.close()


class NoStreamedUpdates:
    """A run whose streamed units are all updated by the gradient sink: an empty set."""

    units: tuple[int, ...] = ()

    def end_step(self, step: int, sq_norms: list[torch.Tensor], sync: bool, for_checkpoint: bool) -> None:
        pass

    def close(self) -> None:
        pass
