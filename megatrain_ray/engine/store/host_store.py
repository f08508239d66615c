"""The host parameter/optimizer store: flat per-kind arrays in shared memory, one block per unit.

Kinds (each one segment, each unit a page-aligned block at the same element offset in all):

- ``master``      master weights (precision policy: fp32, or bf16); a LoRA run's frozen base in the
                  compute dtype, or stored quantized (lora.base_format nf4, int8, mxfp4): its bytes, one
                  record per parameter (:mod:`megatrain_ray.engine.store.quantized`)
- ``stream``      compute-dtype copy that is streamed to the device (only when it differs)
- ``exp_avg``, ``exp_avg_sq``  AdamW states, fp32; with the compact state (optim.state 8bit) uint8
                  codes, and ``exp_avg_scale``, ``exp_avg_sq_scale`` their fp32 block scales, one per
                  :data:`~megatrain_ray.engine.compact.BLOCK` elements (see :mod:`megatrain_ray.engine.compact`)
- ``grad``        the step's gradient in the gradient dtype (precision policy), written by the
                  compute worker; only when there is no stream copy or the gradient dtype differs
                  from it. Otherwise the gradient is written into the unit's stream block, which is dead from the unit's last fetch of step t until the sink
                  refreshes it after the step-t update (the prefetcher never streams it between).
                  With its own array and without global-norm clipping, each unit is updated as
                  soon as its gradient arrives, so ``grad`` is only a ring of ``grad_slots``
                  unit-sized slots (handed back by the sink after each update) instead of a
                  whole-model array: 10 instead of 12 bytes per parameter with bf16 master. With
                  clipping the same ring serves when the gradients wait on the device for the
                  step's norm (``hold_grads``, experimental.hold_grads): 10 with clipping too.
- ``peer_grad``   with experimental.grad_reduce=host and N compute workers: N-1 more whole-model gradient
                  arrays (gradient dtype), one per worker but the first, which writes to ``grad``
                  as above; the gradient sink sums them into it (see :mod:`megatrain_ray.engine.grad_reduce`)
- ``versions``    int64, two per unit: how many optimizer updates its stream copy has received
                  (what the prefetcher waits for), then how many its master weights and moments
                  have (what a checkpoint waits for); they differ only while the sink's second
                  pass of a split update is on its way (see :mod:`megatrain_ray.engine.sink.gradient_sink`);
                  then one more: the *checkpoint copy*, set while a checkpoint still reads the host copy
                  of the units resident on the compute worker (memory.resident, :mod:`megatrain_ray.engine.compute.resident`)

:class:`HostStore` maps the segments (any actor on the node); :class:`ParameterStore` owns them:
it creates, initialises (random, or from a Hugging Face checkpoint, shard by shard), saves
them as a Hugging Face safetensors checkpoint, and removes them.
"""

from __future__ import annotations

import os
import time
from dataclasses import KW_ONLY, dataclass

import torch

import dataclasses

from ...config import LoraSection, ModelConfig, TrainConfig
from ...model.layout import StoreLayout
from ...model.precision import Precision
from ...model.quant_layout import QuantLayout
from ...model.transformer import hf_name
from . import reaper, shm
from ..compact import BLOCK, num_blocks
from .init_weights import draw_random
from .quantized import QuantizedBase

WEIGHT_KINDS = ("master", "stream", "exp_avg", "exp_avg_sq", "grad", "peer_grad")
SCALE_KINDS = ("exp_avg_scale", "exp_avg_sq_scale")
"""The compact state's block scales (only with optim.state 8bit)."""
GRAD_RING_SLOTS = 3
"""Slots of the gradient ring (see the module docstring): one being written, one being updated, one spare."""


def grad_slots_for(precision: Precision, max_grad_norm: float, workers: int = 1, hold_grads: bool = False) -> int:
    """``StoreSpec.grad_slots`` of a run: a ring when the gradient has no stream block to live in
    and no clipping factor holds the updates back until the whole model's gradient is in (or the
    gradients wait for it on the device: :func:`holds_grads`), with one compute worker per store
    (several would have to agree on each slot); else 0."""
    ring = not precision.grad_in_stream_block and workers == 1 and (max_grad_norm <= 0 or hold_grads)
    return GRAD_RING_SLOTS if ring else 0


def peer_grads_for(grad_reduce: str, workers: int) -> int:
    """``StoreSpec.peer_grads`` of a run: with experimental.grad_reduce=host, one gradient array per
    compute worker of the node but the first; with allreduce none."""
    return workers - 1 if grad_reduce == "host" else 0
def holds_grads(precision: Precision, max_grad_norm: float, workers: int = 1, hold_grads: bool = False) -> bool:
    """``StoreSpec.hold_grads`` of a run: experimental.hold_grads (``hold_grads``, resolved) where it
    saves the whole-model host gradient array, i.e. with clipping, no stream block and one compute
    worker."""
    return hold_grads and max_grad_norm > 0 and not precision.grad_in_stream_block and workers == 1


def largest_streamed(layout: StoreLayout, resident: tuple[int, ...]) -> int:
    """Elements of the largest unit the prefetcher streams (what a device weight slot holds): every
    unit but those resident on the compute worker."""
    return max((t.numel for i, t in enumerate(layout.templates) if i not in resident), default=1)


@dataclass(frozen=True)
class VersionWords:
    """Where each count lives in the store's int64 ``versions`` segment (see the module docstring)."""

    units: int
    """Units of the layout."""

    def stream(self, i: int) -> int:
        """The word of unit i's stream version (updates its streamed weights have received)."""
        return i

    def state(self, i: int) -> int:
        """The word of unit i's state version (updates its master weights and moments have received)."""
        return self.units + i

    @property
    def checkpoint_copy(self) -> int:
        """The word of the resident units' checkpoint copy (see :meth:`HostStore.checkpoint_copy`)."""
        return 2 * self.units

    @property
    def numel(self) -> int:
        """Words of the segment."""
        return 2 * self.units + 1


def resident_units(model: ModelConfig, layers: int | None) -> tuple[int, ...]:
    """The units resident on the compute worker's device as memory.resident resolves them (see
    :func:`megatrain_ray.config.execution.describe_resident`): none for None, else the embedding,
    the head (final norm and, untied, the LM head) and the first ``layers`` decoder layers."""
    if layers is None:
        return ()
    layout = StoreLayout.build(model)
    return (layout.embed.index, *(u.index for u in layout.layers if u.layer < layers), layout.head.index)


@dataclass(frozen=True)
class StoreSpec:
    """Everything an actor needs to map the store (small and picklable)."""

    model: ModelConfig
    precision: Precision
    shm_dir: str
    owner_pid: int
    run_id: str
    _: KW_ONLY
    owner_host: str = ""
    """The host name of the machine the run's driver (process ``owner_pid``) runs on, "" if unknown: a
    role on that machine writes no checkpoint once the driver is gone (:func:`~megatrain_ray.io.writer.driver_gone`)."""
    grad_slots: int = 0
    """0: a gradient block per unit; n > 0: a ring of n slots of the largest unit (see the module docstring)."""
    peer_grads: int = 0
    """Whole-model gradient arrays of the workers 1.. of the node (experimental.grad_reduce=host), or 0."""
    hold_grads: bool = False
    """The compute worker keeps the step's gradients on the device until the step's norm is known, then
    sends them through the ring in update order, each ticket carrying that norm (experimental.hold_grads)."""
    resident: tuple[int, ...] = ()
    """Units resident on the compute worker (memory.resident): it keeps their weights and AdamW states on
    its device and updates them there; none is fetched or updated by the sink, and their blocks here
    are a copy brought up to date at checkpoint boundaries (see :mod:`megatrain_ray.engine.compute.resident`)."""
    lora: LoraSection = dataclasses.field(default_factory=LoraSection)
    """A LoRA run's adapters (lora.rank > 0): the base is frozen, stored as its master weights alone, in
    the compute dtype (no moments, no gradients, no stream copy); the adapters live on the compute
    worker's device (:mod:`megatrain_ray.engine.compute.adapters`)."""

    @classmethod
    def of_run(cls, cfg: TrainConfig, precision: Precision, device: str, owner_pid: int, run_id: str,
               resident: tuple[int, ...] = ()) -> StoreSpec:
        """The store of one node of a run of ``cfg`` on ``device`` whose compute worker holds the units
        ``resident`` (as the run resolved memory.resident): its gradient ring, held gradients and
        peer gradient copies as the run's settings resolve (a sharded optimizer across nodes updates
        after the last gradient, from whole-model gradient blocks; held gradients need a single
        compute worker in the whole run)."""
        clip = cfg.optim.max_grad_norm
        if cfg.lora.enabled:  # a frozen base: its weights alone, as the GPU reads them
            return cls(cfg.model, dataclasses.replace(precision, master=precision.compute), cfg.memory.shm_dir,
                       owner_pid, run_id, lora=cfg.lora)
        sharded = cfg.parallel.sharded_optimizer
        hold_grads = (not sharded and not resident and cfg.optim.placement != "device"  # else: updated on the device
                      and holds_grads(precision, clip, cfg.parallel.workers, cfg.experimental.hold_grads_on(device)))
        slots = 0 if sharded else grad_slots_for(precision, clip, cfg.parallel.compute_workers, hold_grads)
        return cls(cfg.model, precision, cfg.memory.shm_dir, owner_pid, run_id, grad_slots=slots,
                   peer_grads=peer_grads_for(cfg.experimental.grad_reduce, cfg.parallel.compute_workers),
                   hold_grads=hold_grads, resident=resident)

    def path(self, kind: str) -> str:
        return shm.segment_path(self.shm_dir, self.owner_pid, self.run_id, kind)

    def dtype(self, kind: str) -> torch.dtype:
        if kind == "master" and self.lora.quantized:  # the base's bytes (megatrain_ray.engine.store.quantized)
            return torch.uint8
        if kind == "master":
            return self.precision.master
        if kind == "stream":
            return self.precision.compute
        if kind in ("grad", "peer_grad"):
            return self.precision.grad
        if kind in ("exp_avg", "exp_avg_sq"):
            return self.precision.optim_state
        return torch.float32

    def kinds(self) -> tuple[str, ...]:
        p = self.precision
        if self.lora.enabled:
            return ("master",)
        return tuple(k for k in WEIGHT_KINDS if not (k == "stream" and not p.separate_stream_copy
                                                      or k == "grad" and p.grad_in_stream_block
                                                      or k == "peer_grad" and not self.peer_grads)) + (
            SCALE_KINDS if p.compact else ())

    def block_starts(self, kind: str) -> list[int]:
        """Element offsets in one kind's array where a block starts (a unit's block, a ring slot, a
        peer copy's unit): no copy to or from the device crosses one, so pinned memory may be
        registered in pieces cut there (:func:`megatrain_ray.engine.compute.device.pin_in_pieces`)."""
        if kind == "master" and self.lora.quantized:  # a quantized base's bytes
            return list(QuantLayout.build(self.model, self.lora.base_format, self.precision.compute).offsets)
        layout = StoreLayout.build(self.model)
        if kind == "grad" and self.grad_slots:
            return [k * layout.slot_numel for k in range(self.grad_slots)]
        if kind in SCALE_KINDS:
            return [o // BLOCK for o in layout.offsets]
        copies = self.peer_grads if kind == "peer_grad" else 1
        return [c * layout.total + o for c in range(copies) for o in layout.offsets]

    def numel(self, kind: str) -> int:
        """Elements of one kind's array."""
        layout = StoreLayout.build(self.model)
        if kind == "master" and self.lora.quantized:
            return QuantLayout.build(self.model, self.lora.base_format, self.precision.compute).total
        if kind == "grad" and self.grad_slots:
            return self.grad_slots * layout.slot_numel
        if kind == "peer_grad":
            return self.peer_grads * layout.total
        if kind in SCALE_KINDS:
            return layout.total // BLOCK
        return layout.total

    def nbytes(self) -> int:
        """Bytes of shared memory the store takes."""
        layout = StoreLayout.build(self.model)
        return sum(self.numel(k) * self.dtype(k).itemsize for k in self.kinds()) + 8 * VersionWords(
            len(layout.units)).numel


class HostStore:
    """A mapping of the store's segments in this process; views are zero-copy and writable."""

    def __init__(self, spec: StoreSpec, create: bool = False):
        self.spec = spec
        self.layout = StoreLayout.build(spec.model)
        open_ = shm.create if create else shm.attach
        self.arrays = {k: open_(spec.path(k), spec.numel(k), spec.dtype(k)) for k in spec.kinds()}
        self.words = VersionWords(len(self.layout.units))
        self.versions = open_(spec.path("versions"), self.words.numel, torch.int64)
        self.base = QuantizedBase(spec.model, spec.lora.base_format, spec.precision.compute,
                                  self.arrays["master"]) if spec.lora.quantized else None
        """A quantized base's bytes (lora.base_format, :mod:`megatrain_ray.engine.store.quantized`), or None."""

    def block(self, kind: str, i: int) -> torch.Tensor:
        """Unit i's flat block [numel] of one kind.

        ``stream`` is the master block when there is no separate stream copy, and ``grad`` is the
        stream block when there is one (see the module docstring). With a quantized base, a unit of raw
        records alone (the embedding, the head) has its compute-dtype block; the others have bytes
        (:meth:`fetch`, :meth:`write`, :meth:`params`).
        """
        if self.base is not None and kind in ("master", "stream"):
            return self.base.weights(i)
        if kind == "stream" and "stream" not in self.arrays:
            kind = "master"
        elif kind == "grad" and "grad" not in self.arrays:
            kind = "stream"
        elif kind == "grad" and self.spec.grad_slots:
            raise ValueError("the gradients are in a ring of slots: use grad_block(unit, slot)")
        return self.layout.block(self.arrays[kind], i)

    def scale_block(self, kind: str, i: int) -> torch.Tensor:
        """Unit i's block scales [ceil(numel / BLOCK)] of one of :data:`SCALE_KINDS` (a view)."""
        start = self.layout.offsets[i] // BLOCK
        return self.arrays[kind][start:start + num_blocks(self.layout.templates[i].numel)]

    def grad_block(self, i: int, slot: int = -1, copy: int = 0) -> torch.Tensor:
        """Where unit i's gradient is written: its grad (or stream) block, or ring slot ``slot``;
        ``copy`` k > 0: worker k's own block in ``peer_grad`` (experimental.grad_reduce=host)."""
        if copy:
            if not 0 < copy <= self.spec.peer_grads:
                raise ValueError(f"gradient copy {copy} is not one of the store's {self.spec.peer_grads} peer copies")
            total = self.layout.total
            return self.layout.block(self.arrays["peer_grad"][(copy - 1) * total:copy * total], i)
        if not self.spec.grad_slots:
            return self.block("grad", i)
        if not 0 <= slot < self.spec.grad_slots:
            raise ValueError(f"gradient slot {slot} is not one of the ring's {self.spec.grad_slots}")
        start = slot * self.layout.slot_numel
        return self.arrays["grad"][start:start + self.layout.templates[i].numel]

    def params(self, kind: str, i: int) -> dict[str, torch.Tensor]:
        """Unit i's parameters of one kind, views into its block; a quantized base's: dequantized copies."""
        if self.base is not None and kind in ("master", "stream"):
            return self.base.params(i)
        return self.layout.templates[i].bind(self.block(kind, i))

    def write(self, i: int, name: str, value: torch.Tensor) -> None:
        """Set unit i's master parameter ``name`` to ``value`` (converted; quantized for a quantized base)."""
        if self.base is not None:
            self.base.write(i, name, value)
        else:
            self.params("master", i)[name].copy_(value)

    def fetch(self, i: int, ranges) -> tuple[torch.Tensor, list[tuple[int, int]] | None]:
        """(host tensor, ranges) that a fetch of unit i's streamed weights copies, for the element
        ``ranges`` it needs (None: all): its stream block, or a quantized base's bytes and byte ranges."""
        if self.base is not None:
            return self.base.fetch(i, ranges)
        return self.block("stream", i), ranges

    def version(self, i: int) -> int:
        """Updates unit i's stream copy (the weights the device fetches) has received."""
        return int(self.versions[self.words.stream(i)])

    def state_version(self, i: int) -> int:
        """Updates unit i's master weights and AdamW moments have received (a checkpoint's boundary)."""
        return int(self.versions[self.words.state(i)])

    def set_version(self, i: int, value: int) -> None:
        """Unit i is wholly at ``value`` updates: its state first, then its stream copy."""
        self.versions[self.words.state(i)] = value
        self.versions[self.words.stream(i)] = value

    def set_stream_version(self, i: int, value: int) -> None:
        """Unit i's stream copy (and moments) are at ``value`` updates, its master not yet."""
        self.versions[self.words.stream(i)] = value

    def set_state_version(self, i: int, value: int) -> None:
        """Unit i's master weights have caught up with its stream copy at ``value`` updates."""
        self.versions[self.words.state(i)] = value

    @staticmethod
    def wait_until(condition, timeout_s: float, pause: float = 0.002) -> bool:
        """Poll ``condition()`` (a test of versions other processes write) until it holds or
        ``timeout_s`` pass; whether it held."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
        return True

    def checkpoint_copy(self) -> int | None:
        """The boundary whose checkpoint still reads the host copy of the resident units, or None."""
        held = int(self.versions[self.words.checkpoint_copy])
        return held - 1 if held else None

    def set_checkpoint_copy(self, step: int | None) -> None:
        """Hold the resident units' host copy for the checkpoint of boundary ``step`` (None: release it)."""
        self.versions[self.words.checkpoint_copy] = 0 if step is None else step + 1

    @property
    def separate_stream_copy(self) -> bool:
        return "stream" in self.arrays

    def refresh_stream(self, i: int) -> None:
        """Copy unit i's master weights into its compute-dtype stream copy (if there is one)."""
        if self.separate_stream_copy:
            self.block("stream", i).copy_(self.block("master", i))


class ParameterStore:
    """Owner of the shared-memory store (plain class; made a Ray actor at spawn).

    ``reap``: start a :mod:`~megatrain_ray.engine.store.reaper` that removes the segments if this process
    dies without closing them (a pipeline's stores do; a store made for a test or a tool need not).
    """

    def __init__(self, spec: StoreSpec, seed: int, init_from: str | None = None,
                 num_threads: int | None = None, resume_from: str | None = None, reap: bool = False):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.spec = spec
        self.init_from = init_from
        self.store = HostStore(spec, create=True)
        try:
            if reap:  # the segments go within a second of this process's death, however it dies
                reaper.start(shm.run_segments(spec.shm_dir, spec.owner_pid, spec.run_id), [os.getpid()])
            for array in self.store.arrays.values():  # fault every page in now, not during step 1
                array.zero_()
            if resume_from is not None and not spec.lora.enabled:
                self.load_checkpoint(resume_from)
            elif init_from is None:
                draw_random(self.store, self.spec, seed)
            else:
                self._load_hf(init_from)
            if resume_from is not None and spec.lora.enabled:  # its checkpoint holds the adapters alone: the
                self._frozen_at(resume_from)  # base, loaded as at the start, is at the checkpoint's step
        except BaseException:
            self.close()
            raise

    def ready(self) -> int:
        """Bytes of shared memory held (called to wait for initialisation)."""
        return self.spec.nbytes()

    def _load_hf(self, directory: str) -> None:
        """Copy an HF checkpoint into the master blocks, shard by shard (see :mod:`megatrain_ray.io.hf_io`)."""
        from ...io import bnb_checkpoint, hf_io

        if bnb_checkpoint.quantization(directory) is not None:  # a bitsandbytes 4-bit checkpoint, read as it is
            bnb_checkpoint.load_into(self.store, directory)
        else:
            hf_io.load_into(self.store, directory)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Master weights as HF-named tensors (copies; for small models and tests)."""
        out = {}
        for i, unit in enumerate(self.store.layout.units):
            for name, p in self.store.params("master", i).items():
                out[hf_name(unit, name)] = p.clone()
        return out

    def save_hf(self, directory: str, shard_bytes: int = 2 * 2**30, tokenizer: str | None = None) -> list[str]:
        """Write the master weights as a sharded HF safetensors checkpoint plus config.json and the run's
        ``tokenizer`` (a directory or BYTE_LEVEL; None: train.init_from's, if it has one); see
        :func:`megatrain_ray.io.hf_io.save_store`."""
        from ...data.tokenizer import is_tokenizer_dir
        from ...io import hf_io

        if tokenizer is None and is_tokenizer_dir(self.init_from):
            tokenizer = self.init_from
        return hf_io.save_store(self.store, directory, shard_bytes, source=self.init_from, tokenizer=tokenizer)

    def _frozen_at(self, directory: str) -> None:
        """Mark a LoRA run's frozen base as at the step of its checkpoint ``directory``: a frozen unit's
        version counts the steps done (its update is none)."""
        from ...io import checkpoint

        step = checkpoint.read_meta(directory)["step"]
        for i in range(len(self.store.layout.units)):
            self.store.set_version(i, step)

    def load_checkpoint(self, directory: str) -> int:
        """Master weights, AdamW states and unit versions from a training checkpoint; returns its step
        (see :mod:`megatrain_ray.io.checkpoint`)."""
        from ...io import checkpoint

        return checkpoint.load_into(self.store, directory)

    def save_checkpoint(self, checkpoints, step: int) -> str:
        """Write the store, which must be at the boundary after ``step`` updates, as a training
        checkpoint of ``checkpoints`` (a :class:`~megatrain_ray.io.checkpoint.CheckpointSettings`) through the run's
        one writer, :class:`~megatrain_ray.io.writer.CheckpointWriter`; returns its path."""
        from ...io.writer import CheckpointWriter

        return CheckpointWriter(self.store, checkpoints).save(step)

    def close(self) -> list[str]:
        """Remove this run's segments (idempotent)."""
        return shm.remove_run(self.spec.shm_dir, self.spec.owner_pid, self.spec.run_id)
