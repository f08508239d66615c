"""The adapters of a LoRA run (lora.rank > 0): resident on the compute worker's device with their AdamW.

The base model is frozen: its weights stream through the device slots as in full fine-tuning, but no
weight gradient is computed for them (their tensors are no autograd leaves, so the backward runs
only the input-gradient GEMMs), none leaves the device and the sink updates nothing. What trains
is each decoder layer's adapter unit (:class:`~megatrain_ray.model.lora.AdapterLayout`): its fp32
master, AdamW moments and fp32 gradient live here for the whole run, with a compute-dtype copy
that the forward binds beside the layer's streamed weights. The gradient norm that clips them is
theirs alone (the frozen base has none): each layer's squared norm goes to the sink in that
layer's ticket (0 for the embedding and the head), which sums them in arrival order for the step's
stats, and this worker sums the same floats in the same order for the clipping factor
(:func:`~megatrain_ray.engine.compute.resident.step_sq_norm`), then updates every adapter at the end of the
step's backward through the optimizer protocol of the device-side units of memory.resident
(:class:`~megatrain_ray.engine.compute.resident.DeviceAdamW`).

With several compute workers each holds its own copy of the adapters, initialised alike, and each
unit's gradient is summed over them (the all-reduce of :class:`~megatrain_ray.engine.compute.grad_out.GradOut`)
before its norm is taken, so every copy takes the same update; the first worker writes the
checkpoints and the export.

A run without adapters holds the empty set, :class:`NoAdapters` (no unit trained here, none of
their parameters or gradients, nothing to update at a step's end), so the compute worker's step
asks its adapters what to bind and never whether there are any.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from ...config import OptimConfig
from ...errors import CheckpointError, PipelineError
from ...io import lora_checkpoint, peft_io
from ...io.writer import driver_gone
from ...model.lora import AdapterLayout, dropout_masks, is_adapter
from ...model.transformer import Params, hf_name
from ..optim import AdamWRunner, step_clipping
from .resident import DeviceAdamW, step_sq_norm


class _Templates(NamedTuple):
    """The templates of what the adapters' optimizer updates, by its index (as a layout's)."""

    templates: tuple


class DeviceAdapters:
    """Every adapter unit's weights, AdamW state and gradient on ``device`` (see the module docstring)."""

    def __init__(self, store, seed: int, device: torch.device, optim: OptimConfig, total_steps: int, threads: int = 1,
                 checkpoints=None, resume_from: str | None = None):
        """store: the compute worker's :class:`~megatrain_ray.engine.store.host_store.HostStore` (its spec's model,
        lora section and compute dtype; its base, for the merged export); seed: of the adapters'
        initialisation; plan: the run's
        :class:`~megatrain_ray.io.checkpoint.CheckpointSettings` (None: no checkpoints); resume_from: a LoRA
        checkpoint whose state the adapters take instead (:meth:`resume`)."""
        self.store, self.cfg, self.lora, self.seed = store, store.spec.model, store.spec.lora, seed
        cfg, lora, compute_dtype = self.cfg, self.lora, store.spec.precision.compute
        self.layout = AdapterLayout.build(cfg, lora)
        self.optim, self.total_steps = optim, total_steps
        self.runner = AdamWRunner(threads) if device.type == "cpu" else None
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        """unit -> master, exp_avg, exp_avg_sq ([numel] fp32) and weights (the master in the compute dtype)
        of its adapters, or of its matrix trained in full (``weights``: that matrix in :attr:`blocks`)."""
        self.blocks: dict[int, torch.Tensor] = {}
        """The units trained in full, by their index in the store: each one's block on the device in the
        compute dtype (the frozen head's norm beside its trained LM head), which the forward reads."""
        for unit, template in self.layout.trained:
            if unit in self.layout.units:
                master = self.layout.init(unit, seed)
                self._take_base(unit, template, master)
                master = master.to(device)
                weights = master if compute_dtype == torch.float32 else master.to(compute_dtype)
            else:  # a base matrix trained in full, starting from the base's (PEFT's modules_to_save)
                index = store.layout.units.index(unit)
                self.blocks[index] = store.block("stream", index).to(device, copy=True)
                (name, _, _), = template.params
                weights = store.layout.templates[index].bind(self.blocks[index])[name].view(-1)
                master = weights.float()  # the matrix itself where the compute dtype is fp32
            self.state[unit] = {"master": master, "exp_avg": torch.zeros_like(master),
                                "exp_avg_sq": torch.zeros_like(master), "weights": weights}
        self.optimizer = DeviceAdamW({i: self.state[u] for i, (u, _) in enumerate(self.layout.trained)}, self.runner,
                                     optim, total_steps, _Templates(tuple(t for _, t in self.layout.trained)))
        """The device units' optimizer protocol (:class:`~megatrain_ray.engine.compute.resident.DeviceAdamW`), by index."""
        self.grads: dict[str, torch.Tensor] = {}
        """unit -> this step's gradient [numel] fp32, accumulated over the micro-batches, until the update."""
        self.version = 0
        """Updates applied."""
        self.covered = range(len(store.layout.units))
        """The store's units whose gradient tickets carry this set's gradient norm: every one (a unit
        without adapters sends a zero norm; :class:`~megatrain_ray.engine.compute.grad_out.AdapterNorm`)."""
        self.checkpoints = checkpoints
        if resume_from is not None:
            self.resume(resume_from)

    def _take_base(self, unit: str, template, master: torch.Tensor) -> None:
        """Copy into ``unit``'s adapter master [numel] the base's value of each base weight trained in
        full beside its adapters (a sparse layer's router under lora.train_router)."""
        names = [n for n, _, _ in template.params if not is_adapter(n)]
        if names:
            index = self.store.layout.units.index(unit)
            base = self.store.layout.templates[index].bind(self.store.block("stream", index))
            views = template.bind(master)
            for name in names:
                views[name].copy_(base[name])

    def params(self, unit: str) -> Params:
        """``unit``'s adapters in the compute dtype, to bind beside its base weights; {} for a unit without."""
        if unit not in self.layout.units:
            return {}
        return self.layout.bind(unit, self.state[unit]["weights"])

    def weights(self, index: int) -> torch.Tensor:
        """The flat weights [numel] of store unit ``index``, trained in full here (one of :attr:`blocks`)."""
        return self.blocks[index]

    def take_grad(self, index: int, grad: torch.Tensor) -> None:
        """Store unit ``index``'s gradient of this step ([numel] fp32, a unit of :attr:`blocks`): its
        trained matrix's part is updated at the end of the step."""
        unit = self.store.layout.units[index]
        (name, _, _), = self.layout.full[[t.unit for t in self.layout.full].index(unit)].params
        self.grads[unit] = self.store.layout.templates[index].bind(grad)[name].view(-1)

    def dropout(self, unit: str, step: int, rows: tuple[int, int], first: int = 0) -> Callable[[int], Params] | None:
        """The dropout masks of ``unit``'s adapters for this worker's training micro-batch m of step
        ``step`` (of ``rows`` = (B, S) tokens; ``first``: the step's index of this worker's first
        micro-batch), as a function of m (:func:`~megatrain_ray.model.lora.dropout_masks`); None
        without dropout or adapters."""
        if not self.lora.dropout or unit not in self.layout.units:
            return None
        device, dtype = self.state[unit]["weights"].device, self.state[unit]["weights"].dtype
        return lambda m: dropout_masks(self.layout, unit, self.lora.dropout, self.seed, step, first + m, rows, device,
                                       dtype)

    def grad(self, unit: str) -> Params:
        """Views of ``unit``'s fp32 gradient buffer (zeroed at its first use in a step), by adapter name."""
        if unit not in self.layout.units:
            return {}
        if unit not in self.grads:
            self.grads[unit] = torch.zeros_like(self.state[unit]["master"])
        return self.layout.template(unit).bind(self.grads[unit])

    def gradient(self, unit: str) -> torch.Tensor | None:
        """``unit``'s gradient of this step ([numel] fp32 on the device, what its update takes), or None
        for a unit that trains nothing here."""
        return self.grads.get(unit)

    def update(self, step: int, sq_norm: float) -> None:
        """Apply step ``step``'s AdamW update to every adapter, clipped by the step's squared gradient
        norm ``sq_norm``; a norm that is not finite raises (nothing is applied)."""
        grads, self.grads = self.grads, {}
        coef = step_clipping(step, math.sqrt(sq_norm), self.optim.max_grad_norm)
        if self.version != step:
            raise PipelineError(f"the adapters have {self.version} updates but step {step} updates them.")
        for i, (unit, _) in enumerate(self.layout.trained):
            if unit not in grads:
                raise PipelineError(f"the adapters of {unit} got no gradient in step {step}.")
            self.optimizer.update(i, grads[unit], coef, step)  # the gradient: fp32, scaled in place
        self.version = step + 1

    def end_step(self, step: int, sq_norms: list[torch.Tensor], backend) -> None:
        """At the end of step ``step``'s backward: :meth:`update`, clipped by the squared norm summed from
        every unit's ``sq_norms`` (:func:`~megatrain_ray.engine.compute.resident.step_sq_norm`), a compute
        span of ``backend``'s."""
        with backend.compute("adamw (adapters)"):
            self.update(step, step_sq_norm(sq_norms))

    def step_result(self, boundary: int, for_checkpoint: bool) -> dict:
        """What the step ending at ``boundary`` adds to its result: the notice of the checkpoint the
        adapters write there ({"checkpoint": :meth:`checkpoint`'s notice}) where it is a checkpoint's
        (``for_checkpoint``) and this worker writes them (the first: it has the checkpoint settings);
        else nothing."""
        if not for_checkpoint or self.checkpoints is None:
            return {}
        return {"checkpoint": self.checkpoint(boundary)}

    def masters(self) -> dict[str, torch.Tensor]:
        """unit -> its adapters' fp32 master [numel], copied to the CPU."""
        return {unit: s["master"].cpu() for unit, s in self.state.items()}

    def host_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """unit -> {master, exp_avg, exp_avg_sq}: copies on the CPU (for a checkpoint)."""
        return {unit: {k: s[k].to("cpu", copy=True) for k in lora_checkpoint.STATE_KINDS}
                for unit, s in self.state.items()}

    def resume(self, directory: str) -> None:
        """Take the state of the LoRA checkpoint ``directory`` bit for bit (:mod:`megatrain_ray.io.lora_checkpoint`)."""
        self.version, states = lora_checkpoint.load(directory, self.cfg, self.lora)
        for unit, s in self.state.items():
            for kind in lora_checkpoint.STATE_KINDS:
                s[kind].copy_(states[unit][kind])
            if s["weights"] is not s["master"]:
                s["weights"].copy_(s["master"])

    def checkpoint(self, step: int) -> dict:
        """Write the plan's checkpoint of boundary ``step`` from the adapters, which must have had
        ``step`` updates; returns its notice for the driver {checkpoint, step, save_s, by}."""
        if self.version != step:
            raise PipelineError(f"the adapters have {self.version} updates, so the checkpoint of step {step} cannot "
                                "be written from them.")
        gone = driver_gone(self.store.spec)
        if gone:
            raise CheckpointError(f"refusing to checkpoint step {step}: {gone}.")
        began = time.time()
        path = lora_checkpoint.save(self.checkpoints, step, self.cfg, self.lora, self.host_states())
        return {"checkpoint": path, "step": step, "save_s": time.time() - began, "by": "compute"}

    def export(self, adapter_dir: str, merged_dir: str | None, tokenizer: str | None = None,
               source: str | None = None, dtype: torch.dtype | None = None,
               shard_bytes: int = peft_io.DEFAULT_SHARD_BYTES) -> list[str]:
        """Write (``merged_dir``) the store's base with the adapters merged in as an HF model directory
        (in ``dtype``, the store's by default; shards of at most ``shard_bytes``), then the adapters as
        a PEFT adapter directory (which may lie inside the merged one); ``source``: the base's
        directory. Returns the merged model's shard files."""
        store, masters = self.store, self.masters()
        full = {hf_name(t.unit, name): masters[t.unit].view(shape) for t in self.layout.full
                for name, shape, _ in t.params}  # the matrices trained in full, by HF name
        shards, units = [], store.layout.units

        def base(unit: str, name: str) -> torch.Tensor:
            return store.params("master", units.index(unit))[name]

        if merged_dir is not None:
            shards = peft_io.save_merged(merged_dir, self.cfg, self.lora, masters, base,
                                         dtype or store.spec.precision.master, full, source=source,
                                         tokenizer=tokenizer, shard_bytes=shard_bytes)
        peft_io.save_adapters(adapter_dir, self.cfg, self.lora, masters, full, base_model=source, tokenizer=tokenizer,
                              base=base)
        return shards

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


class NoAdapters:
    """The adapters of a run without LoRA: an empty set (see the module docstring)."""

    def __init__(self):
        self.blocks: dict[int, torch.Tensor] = {}
        """No store unit is trained in full here."""
        self.covered = range(0)
        """No unit's ticket carries an adapters' norm: each goes out as its policy says."""

    def params(self, unit: str) -> Params:
        return {}

    def grad(self, unit: str) -> Params:
        return {}

    def dropout(self, unit: str, step: int, rows: tuple[int, int], first: int = 0) -> None:
        return None

    def end_step(self, step: int, sq_norms: list[torch.Tensor], backend) -> None:
        pass

    def step_result(self, boundary: int, for_checkpoint: bool) -> dict:
        return {}

    def export(self, *args, **kwargs) -> list[str]:
        raise PipelineError("this run has no LoRA adapters to export (lora.rank is 0): its weights are the store's.")

    def checkpoint(self, step: int) -> dict:
        raise PipelineError(f"this run has no LoRA adapters to checkpoint at step {step} (lora.rank is 0): its "
                            "checkpoints are the store's.")

    def close(self) -> None:
        pass
