"""The compute worker: runs one training step layer-major over all of its micro-batches.

It holds no model weights across units: each unit's weights arrive in a device slot (announced by
a :class:`~megatrain_ray.engine.tickets.FetchTicket`), are bound to the stateless template for the call,
and the slot is released as soon as the unit is done. One step, as one loop:

1. embedding of every micro-batch;
2. forward of layer 0..L-1 for every micro-batch, keeping each layer's input as the checkpoint (on
   the device or offloaded to host memory) or, for the layers placed so, its whole autograd graph
   (see :mod:`megatrain_ray.engine.compute.activations`);
3. head: final norm, LM head and loss in chunks of tokens (never the full logits), forward and
   backward at once; its gradient goes out;
4. backward of layer L-1..0, recomputing each layer from its checkpoint (or differentiating its
   kept graph), for every micro-batch, accumulating the weight gradient in fp32; each layer's
   gradient goes out as soon as it is done;
5. embedding gradient (the input gradients added into their ids' rows in a fixed order, see
   :mod:`megatrain_ray.engine.compute.embed_grad`; plus the head's when tied) goes out.

A mixture of experts' sparse layers (units with parts: attention and router, shared expert, each
routed expert) run through :meth:`~megatrain_ray.engine.compute.sequence.LayerRunner.forward_routed`, their
router statistics gathered by a :class:`~megatrain_ray.engine.compute.routing.StepRouting`: the
load-balancing loss joins the step's loss, its gradient joins each sparse layer's backward
(recomputed from its checkpoint, or through its kept graph: :mod:`megatrain_ray.engine.compute.passes`), and
the tokens each expert received are returned with the step. An expert that received no token has an exactly zero
gradient: it is neither fetched for the backward nor sent (:mod:`megatrain_ray.engine.experts`).

Units resident on the worker's device (memory.resident, :mod:`megatrain_ray.engine.compute.resident`) are not fetched:
their weights stay on the device, their gradients too (only their norms go out), and they are
updated here at the end of the step; so are a LoRA run's adapters (:mod:`megatrain_ray.engine.compute.adapters`)
and, with optim.placement device or auto, the streamed units whose policy says so, their state
copied in and written back (:mod:`megatrain_ray.engine.compute.device_updates`).

With several compute workers (data parallel, see :mod:`megatrain_ray.engine.grad_reduce`) each
runs this loop over its own share of the step's micro-batches, normalising its loss by the whole
step's token count, and each gradient is summed over all workers before its shard goes out.

The resident units, the adapters and the data-parallel group are always there, chosen once: a run
without them holds the empty set and a group of one (:class:`~.worker_group.GroupOfOne`), so the
step asks them and never whether they exist.

Every model call of the step runs under the SDPA backend of ``compute.attention_backend``
(:func:`sdpa_backend`), applied around the model, which stays a pure function; a step of
train.profile_steps, under torch.profiler too (:mod:`megatrain_ray.engine.compute.profiling`).

Three helper threads keep Python and queue round trips off the critical path: the *loader* takes
fetch tickets as they come and starts each copy into its slot, the *releaser* hands freed slots
back to the prefetcher, and the *grad sender* waits for each gradient's copy to the host store to
complete before sending its ticket to the sink (:mod:`megatrain_ray.engine.compute.grad_out`).
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from typing import Any

import torch

from ...errors import ConfigError, MegatrainError, PipelineError, thread_failed
from ...model.layout import DECODER_LAYER, Unit
from ...model.transformer import embed
from .activations import KEEP, ActivationStore
from .adapters import DeviceAdapters, NoAdapters
from .attention import checked_backend, sdpa_backend
from .device import make_backend
from .embed_grad import add_embedding_grad
from ..experts import ExpertTraffic
from .grad_out import GradOut
from .passes import LayerWeights, StepLayers, layer_passes
from .profiling import profiled
from .head import chunk_loss_sum, head_forward_backward, head_loss
from .device_updates import NoStreamedUpdates, StreamedUpdates
from .resident import NoResidentUnits, ResidentUnits
from .sequence import CompiledLayer, LayerRunner, MicroBatches  # noqa: F401  (CompiledLayer: re-exported)
from .routing import StepRouting
from ..settings import ComputeSettings
from .slot_weights import slot_shape, slot_weights
from ..policy import STREAMED_ON_DEVICE
from ..store.host_store import HostStore, StoreSpec
from ..tickets import NO_PROGRESS, FetchTicket, drain, wait_while_moving
from .worker_group import GroupMember, GroupOfOne


class ComputeWorker(GroupMember):
    """Plain class; made a Ray actor (with a GPU when there is one) at spawn."""

    def __init__(self, spec: StoreSpec, settings: ComputeSettings, fetch_q, grad_q, release_q, grad_slot_q=None,
                 checkpoint=None, resume_from: str | None = None):
        """spec: the node's store; settings: this worker's part of the run; fetch_q, release_q: its
        prefetcher's queues (weights ready in a slot, slots freed); grad_q: to the gradient sink;
        grad_slot_q: the store's free gradient-ring slots (None: no ring); checkpoint, resume_from: LoRA's."""
        self.settings = s = settings
        if s.threads:
            torch.set_num_threads(s.threads)
        self.cfg = spec.model
        wrap = (lambda fn: CompiledLayer(threads=s.compile_threads, fn=fn)) if s.compile else None
        self.runner = LayerRunner(s.mlp_chunk_size, wrap)
        self.head_loss_fn = (CompiledLayer(threads=s.compile_threads, fn=chunk_loss_sum, what="LM head",
                                           backward_at_forward=True) if s.compile else chunk_loss_sum)
        """One loss chunk of the head (:mod:`megatrain_ray.engine.compute.head`), compiled with the layers."""
        self._compile_pool = self.runner.compiled()[0] if s.compile and s.compile_threads > 1 else None
        """The compiled layer whose worker pool is still to be shut down after the first step."""
        self.store = HostStore(spec)
        self.layout = self.store.layout
        self.dtype = spec.precision.compute
        self.chunk = s.loss_chunk_size
        self.timeout_s = timeout_s = s.timeout_s
        self.fetch_q, self.release_q = fetch_q, release_q
        self.device_name = device = s.device
        self.reducer = GroupOfOne()  # this worker's data-parallel group, until it joins one (GroupMember.join_group)
        self.backend = make_backend(device, s.buffer_depth, *slot_shape(self.store, self.dtype))
        self.slot_weights = slot_weights(self.store, self.backend, self.dtype)
        """A streamed unit's weights in its slot: as fetched, or a quantized base's dequantized."""
        placement = s.activations
        if len(placement) != self.cfg.num_hidden_layers:
            raise ConfigError(f"the activation placement names {len(placement)} layers but the model has "
                              f"{self.cfg.num_hidden_layers}; check memory.activations.")
        self.activations = ActivationStore(self.backend, placement)  # host buffers kept across steps
        self.passes = layer_passes(self.cfg, placement)
        """Each decoder layer's pass (:mod:`megatrain_ray.engine.compute.passes`): kept, recomputed or routed."""
        self.attention_backend = checked_backend(s.attention_backend, device)
        pinned = ("stream", "grad") if self.store.separate_stream_copy else ("master", "grad")
        for kind in pinned:
            if kind in self.store.arrays:
                self.backend.register_host(self.store.arrays[kind], spec.block_starts(kind))
        self.resident = ResidentUnits(self.store, self.backend, s.optim, s.total_steps, timeout_s, s.threads or 1,
                                      pinned) if spec.resident else NoResidentUnits()
        self.adapters = DeviceAdapters(self.store, s.seed, self.backend.device, s.optim, s.total_steps, s.threads or 1,
                                       checkpoint, resume_from) if spec.lora.enabled else NoAdapters()
        self.policies = s.policies
        """Each unit's policy: a unit that does not train (:attr:`~megatrain_ray.engine.policy.UnitPolicy.trains`)
        gets no weight gradient computed, only its input gradient (and its adapters')."""
        on_device = tuple(u for u in s.update_order if s.policies[u] == STREAMED_ON_DEVICE)
        self.device_updates = StreamedUpdates(self.store, self.backend, on_device, s.optim, s.total_steps, timeout_s,
                                              s.threads or 1, pinned, self._updates_failed) if on_device else NoStreamedUpdates()
        self._stop = threading.Event()
        self.traffic = ExpertTraffic(self.layout, self.backend, self._stop)
        self.grads_out = GradOut(self.store, self.backend, grad_q, grad_slot_q, timeout_s, self.resident, self.policies,
                                 s.update_order, self.adapters, self.traffic, self.device_updates)
        self.fetches: collections.Counter[str] = collections.Counter()
        self._arrived, self._releases = queue.Queue(), queue.Queue()  # a slot's arrival; a slot to hand back
        self._error: BaseException | None = None
        self._failed: tuple[str, str] = ("", "")
        """(the helper thread whose error ``_error`` is, what it was doing: see :meth:`_thread_error`)."""
        self.doing: dict[str, str] = {}
        """Helper thread -> what it does now (a unit's copy to the device, a slot handed back)."""
        loops = ((self._load_loop, "loader"), (self._release_loop, "releaser"),
                 (lambda: self.grads_out.run(self._stop), "grad-sender"))
        self._threads = [threading.Thread(target=self._guard, args=(f, n), daemon=True, name=n) for f, n in loops]
        for t in self._threads:
            t.start()

    # -- helper threads ----------------------------------------------------------------------

    def _guard(self, loop, name: str) -> None:
        try:
            loop()
        except BaseException as e:  # surfaced by the next _take / run_step
            doing = self.grads_out.doing if name == "grad-sender" else self.doing.get(name, "")
            self._failed = (name, doing)
            self._error = e
            self._arrived.put(None)

    def _updates_failed(self, e: BaseException) -> None:
        """The device-updates thread failed: raised by the compute thread, maybe waiting for weights (:meth:`_take`)."""
        self._failed, self._error = ("device-updates", "updating the streamed units"), e
        self._arrived.put(None)

    def _thread_error(self) -> MegatrainError:
        """The error a helper thread ended with (:func:`~megatrain_ray.errors.thread_failed`)."""
        return thread_failed(self._error, f"the compute worker's {self._failed[0]} thread", self._failed[1])

    def _load_loop(self) -> None:
        """Take fetch tickets as the prefetcher issues them and start each copy into its slot."""
        while not self._stop.is_set():
            try:
                ticket: FetchTicket = self.fetch_q.get(timeout=0.2)
            except queue.Empty:
                continue
            self.doing["loader"] = f"copying {self.layout.units[ticket.unit]} to the device"
            ranges = self.traffic.fetch_ranges(ticket.unit, ticket.step, ticket.refetch)  # a sparse layer's: routed
            host, copies = self.store.fetch(ticket.unit, ranges)  # a quantized base's: its bytes
            handle = self.backend.load(ticket.slot, host, self.layout.units[ticket.unit], copies)
            self._arrived.put((ticket, handle, ranges))

    def _release_loop(self) -> None:
        """Hand freed slot ids back to the prefetcher, as soon as the compute has queued its last use."""
        for slot in drain(self._releases, self._stop):
            self.doing["releaser"] = f"handing device slot {slot} back to the prefetcher"
            wait_while_moving(lambda t: self.release_q.put(slot, timeout=t) or True, self.release_q, self.timeout_s)

    # -- one unit's weights ------------------------------------------------------------------

    def _take(self, unit: int, step: int) -> tuple[FetchTicket | None, torch.Tensor]:
        """Wait for ``unit``'s weights of version ``step``; returns the ticket and its flat slot (no
        ticket, and the resident weights, for a unit resident on this worker)."""
        if unit in self.resident.units:
            weights = self.resident.weights(unit, step)
            if weights is None:  # diverged: wait as for weights that never come (on the queue that would bring
                try:  # them) while the sink stops the run, finishing the checkpoint being written first
                    wait_while_moving(lambda t: (self._arrived.get(timeout=t),), self.fetch_q, self.timeout_s)
                except queue.Empty:
                    pass
                raise PipelineError(self.resident.diverged)  # then say what it says
            return None, weights
        if unit in self.adapters.blocks:  # a LoRA run's, trained in full here
            return None, self.adapters.weights(unit)
        waited = time.time()
        try:
            item, = wait_while_moving(lambda t: (self._arrived.get(timeout=t),), self.fetch_q, self.timeout_s)
            self.backend.note("wait", self.layout.units[unit], waited, time.time())
        except queue.Empty:
            raise PipelineError(f"the compute worker waited {self.timeout_s:.0f} s for the weights of "
                                f"{self.layout.units[unit]} while no message moved between the roles; "
                                f"{NO_PROGRESS}") from None
        if item is None:
            raise self._thread_error()
        ticket, handle, ranges = item
        if (ticket.unit, ticket.step) != (unit, step):
            raise PipelineError(f"fetch out of order: expected {self.layout.units[unit]} for step {step}, "
                                f"got {self.layout.units[ticket.unit]} for step {ticket.step}.")
        if self.store.version(unit) != step:
            raise PipelineError(f"{self.layout.units[unit]} has version {self.store.version(unit)} "
                                f"but step {step} needs version {step}.")
        self.backend.wait(handle)
        record = self.layout.records[unit]
        self.fetches["layers" if record.kind == DECODER_LAYER else record.name] += 1
        return ticket, self.slot_weights.weights(ticket.slot, unit, ranges)

    def _release(self, ticket: FetchTicket | None) -> None:
        if ticket is None:  # a resident unit's weights
            return
        self.backend.release(ticket.slot)
        self._releases.put(ticket.slot)

    # -- one step ----------------------------------------------------------------------------

    def run_step(self, step: int, batch: dict[str, Any], eval_batch: dict[str, Any] | None = None,
                 sync: bool = False, for_checkpoint: bool = False, profile: str | None = None) -> dict[str, Any]:
        """batch: input_ids, labels: [M, B, S] int; eval_batch: the same for validation data, or None;
        sync: the boundary after this step is a checkpoint's or the run's end, so the resident units'
        state goes to the host store after their update; for_checkpoint: a checkpoint's, so that copy stays
        until the checkpoint has it (:func:`~megatrain_ray.engine.compute.resident.sync_due`, ``checkpoint_due``).

        Returns the loss, token count, fetch counts, the step's wall time, and its timeline: busy
        seconds and bytes per lane (h2d, compute, d2h) and the intervals themselves. With an
        ``eval_batch``, also ``val_loss``: its loss under the weights this step's forward uses (after
        ``step`` updates), computed alongside the forward and the head, without gradients. With
        ``profile`` (train.profile_steps), the step's profile goes to its ``worker-<rank>`` (:mod:`.profiling`).
        """
        into = None if profile is None else os.path.join(profile, f"worker-{self.reducer.rank}")
        try:
            with sdpa_backend(self.attention_backend), profiled(into, self.backend.device):
                return self._step(step, batch, eval_batch, sync, for_checkpoint)
        except torch.OutOfMemoryError as e:
            kept = self.activations.modes.count(KEEP)
            if not kept:
                raise
            raise PipelineError(f"the device ran out of memory in step {step} with {kept} layers' activations kept "
                                f"whole; keep fewer (memory.activations: counts, memory.kept_layers: {kept // 2}) or set "
                                "memory.activations to recompute.") from e

    def _step(self, step: int, batch: dict[str, Any], eval_batch: dict[str, Any] | None,
              sync: bool = False, for_checkpoint: bool = False) -> dict[str, Any]:
        if self._error is not None:
            raise self._thread_error()
        self.backend.begin_step()
        self.traffic.begin_step(step)
        start = time.time()
        self.fetches.clear()
        self.activations.clear()  # anything a failed step left
        mb = self._batch(batch)
        evaluation = None if eval_batch is None else self._batch(eval_batch, mb.ids.shape[2])
        routing = StepRouting(self.cfg, len(batch["input_ids"]))
        layers = StepLayers(self.runner, self.cfg, mb, self.activations, routing, self.traffic, step)
        xs, es = self._forward(step, layers, evaluation)
        embed_grad = self._weight_grad(self.layout.embed.index)
        loss, dx, val_loss = self._head(step, xs, mb.labels, mb.n_tokens, embed_grad,
                                        None if evaluation is None else (es, evaluation.labels))
        xs = es = None  # the head has used the last hidden states
        loss = routing.with_aux(loss)  # a mixture of experts' load-balancing loss joins it
        self._backward(step, layers, dx, embed_grad)
        embed_grad = None
        self.grads_out.end_step(step, sync, for_checkpoint)
        saved = self.adapters.step_result(step + 1, for_checkpoint)  # a LoRA checkpoint's notice (the first worker's)
        return {**self._report(step, start, loss, mb.n_tokens, val_loss, routing), **saved}

    def _batch(self, batch: dict[str, Any], seq: int | None = None) -> MicroBatches:
        """The step's micro-batches on the device (this worker's share, in a data-parallel group);
        ``seq``: the training sequences' length, for a validation batch riding along (whole)."""
        share = None if seq is not None else (self.reducer.rank, self.reducer.world)
        return MicroBatches.of(self.cfg, batch, self.backend.device, self.dtype, share, seq)

    @torch.no_grad()
    def _forward(self, step: int, s: StepLayers, evaluation: MicroBatches | None
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Embedding and every decoder layer forward, for every micro-batch (and the validation
        sequences alongside: no extra weight traffic), each layer leaving for its backward what its
        pass says (:mod:`megatrain_ray.engine.compute.passes`; a sparse layer's router statistics into
        ``s.routing``). Returns the last hidden states of both."""
        template = self.layout.templates[self.layout.embed.index]
        ticket, flat = self._take(self.layout.embed.index, step)
        with self.backend.compute("embed"):
            xs = [embed(template.bind(flat), ids) for ids in s.mb.ids]
            es = [] if evaluation is None else [embed(template.bind(flat), e) for e in evaluation.ids]
        self._release(ticket)
        for unit in self.layout.layers:
            ticket, w = self._weights(unit, step, s)
            layer = self.passes[unit.layer]
            with self.backend.compute(unit.name):
                ys = layer.forward(s, unit.layer, w, xs)
                es = [self.runner.forward(w.params, e, evaluation.ctx_of(unit.layer)[m], self.cfg) for m, e in enumerate(es)]
            layer.leave(s, unit.layer, xs)
            xs = ys
            self._release(ticket)
        return xs, es

    def _backward(self, step: int, s: StepLayers, dx: list[torch.Tensor], embed_grad: torch.Tensor | None) -> None:
        """Every decoder layer backward from the head's input gradients ``dx`` (M x [B, S, H], replaced
        layer by layer), as its pass runs it (recomputed from its checkpoint, or its kept graph), then
        the embedding's; each unit's fp32 gradient goes out as soon as it is done (``embed_grad``
        [V*H] holds the head's part with tied embeddings; None: a frozen embedding)."""
        acts = self.activations
        for unit in reversed(self.layout.layers):
            if acts.span_of(unit.layer) is not None:  # a recompute span's last layer: its inputs come back first
                self._span_forward(step, s, *acts.span_of(unit.layer))
            ticket, w = self._weights(unit, step, s)
            inputs = acts.take(unit.layer)
            acts.prefetch(acts.source(unit.layer - 1))  # the next backward's checkpoint comes in while this one computes
            with self.backend.compute(unit.name + " bwd"):
                grad = self._weight_grad(unit.index)  # None: a frozen unit, whose weights get no gradient
                grads = {**({} if grad is None else w.template.bind(grad, fused=True)),
                         **self.adapters.grad(unit.name)}  # what trains: views to add into
                self.passes[unit.layer].backward(s, unit.layer, w, grads, inputs, dx)
            del inputs
            self._release(ticket)
            self.grads_out.send(unit.index, step, grad)
        if embed_grad is not None:
            with self.backend.compute("embed bwd"):  # in token chunks: no fp32 copy of a whole [S, H] gradient
                table = embed_grad.view(self.cfg.vocab_size, self.cfg.hidden_size)
                for m in range(len(dx)):  # in a fixed order, unlike index_add_'s atomics on CUDA
                    rows, grads = s.mb.ids[m].reshape(-1), dx[m].reshape(-1, self.cfg.hidden_size)
                    for a in range(0, rows.shape[0], self.chunk):
                        add_embedding_grad(table, rows[a:a + self.chunk], grads[a:a + self.chunk])
        self.grads_out.send(self.layout.embed.index, step, embed_grad)

    @torch.no_grad()
    def _span_forward(self, step: int, s: StepLayers, first: int, last: int) -> None:
        """Layers first..last-1 forward again from ``first``'s checkpoint, each output held as the next
        layer's input for its backward (a recompute span, :mod:`megatrain_ray.engine.compute.activations`)."""
        xs = self.activations.take(first)
        self.activations.set_inputs(first, xs)
        for unit in [u for u in self.layout.layers if first <= u.layer < last]:
            ticket, w = self._weights(unit, step, s)
            with self.backend.compute(unit.name + " span fwd"):
                xs = self.passes[unit.layer].again(s, unit.layer, w, xs)
            self._release(ticket)
            self.activations.set_inputs(unit.layer + 1, xs)

    def _weights(self, unit: Unit, step: int, s: StepLayers) -> tuple[FetchTicket | None, LayerWeights]:
        """Wait for decoder-layer ``unit``'s weights of version ``step`` (:meth:`_take`); with its adapters
        (a LoRA run's, resident on the device; {} for a unit without), whether its own weights are frozen
        (its policy) and its adapters' dropout in this step."""
        ticket, flat = self._take(unit.index, step)
        first = self.reducer.rank * len(s.mb.ids)  # the step's index of this worker's first micro-batch
        dropout = self.adapters.dropout(unit.name, step, tuple(s.mb.ids.shape[1:]), first)
        return ticket, LayerWeights(self.layout.templates[unit.index], flat, self.adapters.params(unit.name),
                                    not self.policies[unit.index].trains, dropout)

    def _weight_grad(self, unit: int) -> torch.Tensor | None:
        """A zeroed fp32 gradient buffer [numel] for ``unit``'s weights, or None for a unit that does
        not train (its policy), whose backward then computes no weight gradient at all."""
        if not self.policies[unit].trains:
            return None
        return torch.zeros(self.layout.templates[unit].numel, dtype=torch.float32, device=self.backend.device)

    def _report(self, step: int, start: float, loss: torch.Tensor, n_tokens: int, val_loss, routing: StepRouting
                ) -> dict[str, Any]:
        """The step's result, once the device is done with it (see :meth:`run_step`)."""
        intervals = self.backend.end_step()  # waits for the device without spinning a core
        loss = float(loss)
        if self._compile_pool is not None:  # both graphs are compiled by now: give the pool's memory back
            self._compile_pool.release_workers()
            self._compile_pool = None
        extra = {**({} if val_loss is None else {"val_loss": float(val_loss)}), **routing.report()}
        busy = {f"{lane}_busy_s": sum(e - b for ln, _, b, e, _ in intervals if ln == lane)
                for lane in ("h2d", "compute", "d2h", "wait")}
        moved = {f"{lane}_bytes": sum(n for ln, _, _, _, n in intervals if ln == lane) for lane in ("h2d", "d2h")}
        busy["device_update_busy_s"] = sum(e - b for ln, what, b, e, _ in intervals  # AdamW here: the other update path
                                           if ln == "device_update" or ln == "compute" and what.startswith("adamw"))
        extra.update(self.traffic.report(step))
        return {"step": step, "loss": loss, "tokens": n_tokens, "fetches": dict(self.fetches),
                "start": start, "step_s": time.time() - start, **busy, **moved, "intervals": intervals,
                "device_peak_bytes": self.backend.peak_bytes(), "device_alloc_retries": self.backend.alloc_retries(), **extra}

    def _head(self, step: int, hidden: list[torch.Tensor], labels: torch.Tensor, n_tokens: int,
              embed_grad: torch.Tensor, evaluation: tuple[list[torch.Tensor], torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
        """Final norm + LM head + loss, forward and backward, in token chunks.

        hidden: M x [B, S, H]; labels: [M, B, S]. Returns the loss (mean over the step's counted
        tokens), the gradient of each micro-batch's hidden input, and the validation loss of
        ``evaluation`` (hidden states E x [B, S, H], labels [E, B, S]; forward only) or None. The
        head's gradient is sent; with tied embeddings the LM-head part is added into ``embed_grad``
        [V*H] fp32.
        """
        unit = self.layout.head.index
        tied = self.cfg.tie_word_embeddings
        ticket, flat = self._take(unit, step)
        wh, we = flat, None
        tickets = [ticket]
        if tied:
            ticket_e, flat_e = self._take(self.layout.embed.index, step)
            tickets.append(ticket_e)
            we = flat_e
        trains = self.policies[unit].trains  # a LoRA run's head trained in full: its LM head alone, not its norm
        with self.backend.compute("head"):
            loss, dxs, head_grad = head_forward_backward(
                self.cfg, self.layout, self.chunk, wh, we, hidden, labels, n_tokens, embed_grad, self.head_loss_fn,
                train_norm=trains and unit not in self.adapters.blocks,  # a unit trained in full beside adapters
                train_w=trains or (tied and embed_grad is not None))
            val_loss = None if evaluation is None else head_loss(self.cfg, self.layout, self.chunk,
                                                                 wh.detach(), we, *evaluation)
        for t in tickets:
            self._release(t)
        self.grads_out.send(unit, step, head_grad)
        return loss, dxs, val_loss

    def lora(self, call: str, *args):
        """A LoRA run's adapters' ``export`` or ``checkpoint`` (:mod:`megatrain_ray.engine.compute.adapters`;
        refused by a run without)."""
        return getattr(self.adapters, call)(*args)

    def sync_resident(self) -> None:
        """Bring the host store's copy of the resident units up to date (an interrupt's checkpoint)."""
        self.resident.sync()

    def close(self) -> None:
        self.resident.close()
        self.device_updates.close()
        self.adapters.close()
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        self.backend.close()
        self.reducer.close()
