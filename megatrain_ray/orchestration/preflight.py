"""Preflight: what a run needs in /dev/shm, host RAM and device memory, before anything is allocated.

``megatrain-ray plan --config ...`` prints the table; ``train`` computes the same plan and refuses,
with the table and one sentence, a run that would not fit host RAM or memory.shm_dir instead of
letting the OOM killer end it hours later.

This module counts and decides nothing: the device, the store (its precision), the units resident on
the device, each layer's activation placement and the expected step time are chosen once by
:func:`megatrain_ray.orchestration.resolve.resolve` and handed to :func:`count` as
:class:`Decisions`; :func:`count` turns them into rows (bytes per place), and the table says
whether they fit. Only its what-if questions (the largest micro-batch, the longest context that
would fit) place the activations again, for the shapes they try.

Where the bytes go (see :mod:`megatrain_ray.model.precision` for the dtypes):

- **/dev/shm** (counted in host RAM too): the host store, one array per kind (master weights,
  the compute-dtype stream copy or the gradient array, both AdamW moments; every unit padded to a
  page-aligned block), and Ray's object store when this process starts Ray.
- **host RAM**: the above, plus one Python process per actor (torch imported), the token stream
  held by every data loader, and one shard of the final Hugging Face export.
- **device** (the GPU; on a CPU run, host RAM): ``buffer_depth`` weight slots of the largest unit;
  the activations, placed per layer by :func:`activation_counts` (memory.activations): a layer's
  checkpoint (its input, for every micro-batch: tokens per step x hidden), or its whole forward
  graph (:func:`megatrain_ray.engine.compute.activations.kept_bytes_per_token` per token, plus a copy of
  its weights), or its checkpoint in host RAM (leaving ~3 layers' worth in flight on the device),
  and the last layer's output; the input gradients of every micro-batch; the fp32 embedding and
  head gradients; and, never at the same time (so the device total counts the larger, see
  :func:`device_total`), one layer's working set while it is recomputed and differentiated for
  one micro-batch (its activations and their gradients, its fp32 gradient accumulator; with
  memory.mlp_chunk_size, the [tokens, intermediate] terms for one chunk and, at the attention's
  backward, the kernel's scratch: ``tiled_backward_bytes``) or the head's: one loss
  chunk of logits, with their fp32 log-softmax and gradient when eager, in the compute dtype when
  compiled (``buffer_depth``, ``loss_chunk_size``, ``mlp_chunk_size`` and ``compile`` as resolved
  for the run, see MemorySection and ComputeSection).

The device figures are estimates of the dominant terms, the rest are exact sizes. Checked on an
H200 (a 0.5B Llama shape, 2 x 2048-token micro-batches, bf16): the device total without the CUDA
context came out 5-10% above torch's measured peak allocation (3.96 GiB at micro-batch 8,
1.91 GiB at 2), i.e. on the safe side. At long context the layer's working set dominates; its
[tokens, intermediate] coefficient (5 such tensors: gate, up, their product and the gradients of
the first two, in the compute dtype) matches the slope measured on the H200 for the Qwen2.5-7B
shape with offloaded checkpoints (38.5 GiB at 131,072 tokens, 70.9 GiB at 262,144, i.e. 265 KB
per token; this model: 263). The longest context (:func:`longest_context`) is the longest
train.seq_len whose device and host totals both fit, at the configured micro-batch size. The
largest micro-batch is the largest ``train.micro_batch_size`` whose device
total fits the device memory (GPU_USABLE of it on a GPU).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass, field

from ..config import TrainConfig
from ..data.builtin import BUILTIN_LONG_DOCUMENTS, BUILTIN_LONG_VAL_DOCUMENTS
from ..engine.store.host_store import StoreSpec, VersionWords
from ..engine.store.host_store import resident_units  # noqa: F401  (tests reach it from here, beside device_rows)
from ..errors import PreflightError  # noqa: F401  (raised by resolve.check; callers catch it from here)
from ..model import flops
from ..model.layout import StoreLayout
from ..model.lora import AdapterLayout
from .device_memory import (CUDA_CONTEXT_BYTES, GPU_USABLE, Row, _activation_rows, _fixed_device_rows,  # noqa: F401
                            _pinned_size, activation_counts, activation_note, activation_placement, device_rows,
                            device_total, fmt, placed_rows, resolve_resident)
from .pace import Pace, timeout_line
from .store_modes import mode_notes
from .machine import RAY_MEMORY_THRESHOLD  # noqa: F401  (the pipeline's messages quote it from here)
from .machine import host_available, ray_monitor_margin, ray_threshold, same_filesystem

PROCESS_BYTES = 350 * 2**20
"""Resident memory of one actor process with torch imported (measured ~300 MiB on CPU builds)."""
CUDA_HOST_BYTES = 600 * 2**20
"""Host memory the CUDA context adds to the compute worker (measured: 0.89 GiB private against
0.30 for the other actors, on the H200 machine)."""
COMPILE_WORKER_BYTES = 400 * 2**20
"""Host memory of one Inductor compile worker process (16 took 6.3 GiB on the H200 machine)."""
EXPORT_SHARD_BYTES = 2 * 2**30
"""Shard size of the final Hugging Face export (one shard is in memory at a time)."""
_KIND_LABELS = {"master": "master weights", "stream": "stream copy (streamed to the device)",
                "exp_avg": "AdamW exp_avg", "exp_avg_sq": "AdamW exp_avg_sq",
                "grad": "gradients (host side)",
                "peer_grad": "the other workers' gradient copies (experimental.grad_reduce=host)", "exp_avg_scale": "8-bit exp_avg block scales",
                "exp_avg_sq_scale": "8-bit exp_avg_sq block scales"}
@dataclass
class MemoryPlan:
    """The memory a run needs, what the machine has, and the largest micro-batch that fits."""

    title: str
    device: str
    rows: list[Row]
    shm_free: int
    host_available: int
    device_bytes: int | None
    """Memory of the device (None: unknown, e.g. planning a GPU run on a machine without one)."""
    micro_batch_size: int
    largest_micro_batch: int | None
    notes: list[str] = field(default_factory=list)
    longest_context: int | None = None
    """The longest train.seq_len that fits (device and host), at train.micro_batch_size; None: unknown."""
    context_limit: str = ""
    """What a longer context would not fit: GPU memory or host RAM."""
    max_positions: int = 2**62
    """model.max_position_embeddings: the longest context the table offers (memory may allow more)."""
    pace: Pace | None = None
    """The expected step time and what it follows from (:mod:`megatrain_ray.orchestration.pace`), as
    the run decided it (:class:`Decisions`)."""
    resident: tuple[int, ...] = ()
    """The units resident on the device that the plan counts (memory.resident, as the run decided it)."""
    activation_host_bytes: int | None = None
    """Host RAM left for offloaded activation checkpoints once everything else is counted."""
    placement: tuple[str, ...] = ()
    """Each decoder layer's activation placement that the plan counts, as the run decided it."""

    def total(self, where: str) -> int:
        """Bytes needed in ``shm``, ``host`` (shm included, and the device on a CPU run) or ``device``."""
        if where == "host":
            host = sum(r.nbytes for r in self.rows if r.where in ("shm", "host"))
            return host + (self.total("device") if self.device == "cpu" else 0)
        if where == "device":
            return device_total(self.rows)
        return sum(r.nbytes for r in self.rows if r.where == where)

    def problems(self) -> list[str]:
        """One sentence per resource the run does not fit (host RAM, /dev/shm); empty if it fits."""
        out = []
        shm, host = self.total("shm"), self.total("host")
        fix = "use a smaller model, optim.state=8bit or precision.master_dtype=bfloat16"  # the weights and AdamW state
        if shm > self.shm_free:
            out.append(f"the run needs {fmt(shm)} in memory.shm_dir (the weights and AdamW state) but only "
                       f"{fmt(self.shm_free)} is free there; {fix}, enlarge /dev/shm, or use a bigger machine.")
        if host > self.host_available:
            out.append(f"the run needs {fmt(host)} of host RAM but only {fmt(self.host_available)} is available; "
                       f"{fix}, a smaller train.micro_batch_size, or a machine with more memory.")
        return out

    def table(self) -> str:
        where_names = {"shm": "/dev/shm", "host": "host RAM", "device": "CPU" if self.device == "cpu" else "GPU"}
        width = max(len(r.component) for r in self.rows) + 2
        lines = [self.title, f"{'component':<{width}}{'in':<10}{'bytes':>12}"]
        for r in self.rows:
            lines.append(f"{r.component:<{width}}{where_names[r.where]:<10}{fmt(r.nbytes):>12}")

        def total(label: str, need: int, have: int | None, what: str) -> str:
            verdict = "unknown" if have is None else (
                f"{what} {fmt(have)}: {'ok' if need <= have else 'DOES NOT FIT'}")
            return f"{label:<{width}}{'':<10}{fmt(need):>12}  ({verdict})"

        lines.append(total("total /dev/shm", self.total("shm"), self.shm_free, "free"))
        lines.append(total("total host RAM", self.total("host"), self.host_available, "available"))
        if self.device != "cpu":
            have = None if self.device_bytes is None else int(self.device_bytes * GPU_USABLE)
            lines.append(total("total GPU", self.total("device"), have, "usable"))
        if self.largest_micro_batch is None:
            lines.append("largest micro-batch that fits: unknown (no GPU visible; pass --gpu-memory GIB)")
        elif self.largest_micro_batch == 0:
            lines.append(f"largest micro-batch that fits: none (train.micro_batch_size is {self.micro_batch_size})")
        else:
            lines.append(f"largest micro-batch that fits: {self.largest_micro_batch} "
                         f"(train.micro_batch_size is {self.micro_batch_size})")
        if self.longest_context == 0:
            lines.append(f"longest context that fits: none (even 1,024 tokens per sequence exceed the "
                         f"{self.context_limit or 'memory'})")
        elif self.longest_context is not None and self.longest_context > self.max_positions:
            lines.append(f"longest context that fits: {self.max_positions:,} tokens per sequence, the model's "
                         f"model.max_position_embeddings (its memory at micro-batch {self.micro_batch_size} would allow "
                         f"{self.longest_context:,}: raise max_position_embeddings, with RoPE scaling, to use it)")
        elif self.longest_context is not None:
            lines.append(f"longest context that fits: {self.longest_context:,} tokens per sequence at "
                         f"micro-batch {self.micro_batch_size}"
                         + (f" (longer ones exceed the {self.context_limit})" if self.context_limit else ""))
        lines += self.notes
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# What the run needs.

def _tokens_in_data(path: str | None, builtin_document_tokens: int = 0) -> int:
    """Token count of data.path without reading it (a .npy header, a text file's byte count)."""
    if path is None:  # the built-in corpus: ~110 KB, or its long documents
        long = (BUILTIN_LONG_DOCUMENTS + BUILTIN_LONG_VAL_DOCUMENTS) * builtin_document_tokens
        return long or 110_000
    if os.path.isdir(path):
        return sum(_tokens_in_data(os.path.join(path, name)) for name in os.listdir(path)
                   if os.path.isfile(os.path.join(path, name)))
    if path.endswith(".npy"):
        import numpy as np

        try:
            return int(np.load(path, mmap_mode="r").size)
        except (OSError, ValueError):
            return os.path.getsize(path) // 8
    return os.path.getsize(path)


def longest_context(cfg: TrainConfig, device: str, base: MemoryPlan) -> int | None:
    """The longest train.seq_len (a multiple of 1024) whose device total fits the device (90% of a
    GPU) and whose host total (the store, processes, and offloaded checkpoints at that length) fits
    the host's available memory, at ``cfg``'s micro-batch shape; 0 if none; None if the GPU's memory
    is unknown. Model positions (max_position_embeddings) are not a limit here: RoPE extends to any
    length, and the config may raise it."""
    if device != "cpu" and base.device_bytes is None:
        return None
    step = 1024
    here = device_rows(cfg, device, cfg.train.micro_batch_size, base.device_bytes, base.resident,
                       base.activation_host_bytes)  # in base: what changes with the length
    fixed_host = base.total("host") - sum(r.nbytes for r in here if r.where == "host") - (
        device_total(here) if device == "cpu" else 0)

    def fits(seq_len: int) -> bool:
        c = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=seq_len))
        rows = device_rows(c, device, cfg.train.micro_batch_size, base.device_bytes, base.resident,
                           base.activation_host_bytes)  # as it would be
        dev = device_total(rows)
        host = fixed_host + sum(r.nbytes for r in rows if r.where == "host") + (dev if device == "cpu" else 0)
        base.context_limit = "host RAM" if host > base.host_available else (
            "GPU memory" if device != "cpu" and dev > base.device_bytes * GPU_USABLE else "")
        return not base.context_limit

    if not fits(step):
        return 0
    lo, hi = 1, 2
    while fits(hi * step) and hi < 2**24:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
    fits(hi * step)  # records what the next length would exceed
    return lo * step
@dataclass(frozen=True)
class Decisions:
    """What a run's memory plan counts with and never chooses: each decided once, by
    :func:`~megatrain_ray.orchestration.resolve.resolve`, and held by its
    :class:`~megatrain_ray.orchestration.resolve.ResolvedRun` (which :func:`count` counts again, with
    the same decisions, when the machine's free memory changes)."""

    device: str
    """cpu or cuda."""
    device_bytes: int | None
    """The GPU memory the run is planned against (None: unknown, or the cpu device)."""
    store: StoreSpec
    """The host store: its arrays and their dtypes (``store.precision``: the run's precision as the store
    keeps it, a LoRA run's frozen base in the compute dtype)."""
    resident: tuple[int, ...]
    """The units resident on the device by memory.resident (a LoRA run's embedding or head trained in
    full are on the device too, but counted with the adapters)."""
    placement: tuple[str, ...]
    """Each decoder layer's activation placement (:func:`activation_placement`)."""
    pace: Pace
    """The expected step time (:func:`~megatrain_ray.orchestration.pace.expected_pace`)."""
    on_device: tuple[int, ...] = ()
    """The streamed units updated on the device (optim.placement, :mod:`~megatrain_ray.orchestration.placement`)."""


def host_for(host_bytes: int | None) -> int:
    """The host RAM a run is planned against: ``host_bytes`` where given, else what this machine has
    available now."""
    return host_available() if host_bytes is None else host_bytes


def offload_room(cfg: TrainConfig, device: str, store: StoreSpec, starts_ray: bool, host: int) -> int:
    """Of ``host`` bytes of host RAM, those left for offloaded activation checkpoints once everything
    else on the host is counted (what :func:`activation_placement` may offload into)."""
    return host - sum(r.nbytes for r in _host_rows(cfg, device, store, starts_ray))


def _host_rows(cfg: TrainConfig, device: str, store: StoreSpec, starts_ray: bool) -> list[Row]:
    """Every /dev/shm and host-RAM row but the offloaded activation checkpoints' (see the module
    docstring); ``starts_ray``: whether this process starts Ray (its object store then counts)."""
    layout = StoreLayout.build(cfg.model)
    rows = [Row(f"{_store_label(store, k)}{f' ({store.grad_slots} unit slots)' if k == 'grad' and store.grad_slots else ''} "
                f"({str(store.dtype(k)).removeprefix('torch.')})", "shm", store.numel(k) * store.dtype(k).itemsize)
            for k in store.kinds()]
    rows.append(Row("unit versions", "shm", 8 * VersionWords(len(layout.units)).numel))
    if starts_ray:
        same_fs = same_filesystem(cfg.memory.shm_dir, "/dev/shm")
        rows.append(Row("Ray object store", "shm" if same_fs else "host", cfg.cluster.object_store_memory))
    workers = cfg.parallel.compute_workers
    n_proc = 3 + 2 * workers + cfg.data.num_workers
    rows.append(Row(f"{n_proc} processes (driver, store, {workers} x prefetch + compute, sink, loaders)", "host",
                    n_proc * PROCESS_BYTES))
    if device == "cuda":
        rows.append(Row(f"CUDA context, host side ({workers} compute worker(s))", "host", workers * CUDA_HOST_BYTES))
    if cfg.compute.compile_on(device) and cfg.compute.compile_threads > 1:
        rows.append(Row(f"{cfg.compute.compile_threads} compile worker processes (compute.compile_threads, first step)",
                        "host", cfg.compute.compile_threads * COMPILE_WORKER_BYTES))
    margin = ray_monitor_margin()
    if margin:
        rows.append(Row("Ray memory monitor's margin (it kills workers past "
                        f"{ray_threshold():.0%} of RAM)", "host", margin))
    rows.append(Row(f"token stream x {cfg.data.num_workers} loader(s)", "host",
                    _tokens_in_data(cfg.data.path, cfg.data.builtin_document_tokens) * 8 * cfg.data.num_workers))
    if cfg.train.checkpoint_staging_gib:
        rows.append(Row("checkpoint staging copies (train.checkpoint_staging_gib, in the sink)", "host",
                        int(cfg.train.checkpoint_staging_gib * 2**30)))
    if cfg.train.save_final:
        rows.append(Row("one shard of the final export", "host",
                        min(EXPORT_SHARD_BYTES, layout.num_params * store.precision.master.itemsize)))
    return rows


def count(cfg: TrainConfig, decided: Decisions, host: int, starts_ray: bool) -> MemoryPlan:
    """The memory plan of ``cfg`` run as ``decided`` (nothing is allocated, nothing is chosen here): its
    rows, what the machine has (``host`` bytes of host RAM, what is free in memory.shm_dir now), the
    largest micro-batch and the longest context that would fit, and the notes; a run's is part of its
    :class:`~megatrain_ray.orchestration.resolve.ResolvedRun`. ``starts_ray``: whether this process
    starts Ray (its object store then counts)."""
    device, store, resident = decided.device, decided.store, decided.resident
    m = cfg.model
    precision = store.precision  # as the store keeps it (a LoRA run's base: in the compute dtype)
    n_params = StoreLayout.build(m).num_params
    rows = _host_rows(cfg, device, store, starts_ray)
    room = host - sum(r.nbytes for r in rows)  # what offloaded checkpoints may take
    rows += placed_rows(cfg, device, cfg.train.micro_batch_size, resident, decided.placement, decided.on_device)
    shm_free = shutil.disk_usage(cfg.memory.shm_dir).free
    experts = (f", {flops.fmt_count(flops.active_params(m))} active: {m.num_experts_per_tok} of {m.num_experts} experts in "
               f"{len(m.sparse_layers)} sparse layers" if m.is_moe else "")
    if cfg.lora.enabled:
        experts += (f"; LoRA rank {cfg.lora.rank} on {', '.join(cfg.lora.target_modules)}: "
                    f"{flops.fmt_count(AdapterLayout.build(m, cfg.lora).num_params)} adapter parameters, the base "
                    "frozen")
    title = (f"preflight: {m.model_type}, {flops.fmt_count(n_params)} parameters ({m.num_hidden_layers} layers{experts}, "
             f"hidden {m.hidden_size}), device {device}, master {str(precision.master).removeprefix('torch.')}, "
             f"compute {str(precision.compute).removeprefix('torch.')}, {cfg.train.num_micro_batches} x "
             f"{cfg.train.micro_batch_size} sequences of {cfg.train.seq_len} tokens per step"
             + (f"; per node of {cfg.parallel.nodes}, {cfg.parallel.compute_workers} GPU(s) each taking 1/{cfg.parallel.workers} "
                "of the micro-batches (device rows: per GPU)" if cfg.parallel.workers > 1 else ""))
    result = MemoryPlan(title, device, rows, shm_free, host, decided.device_bytes, cfg.train.micro_batch_size, None,
                        pace=decided.pace, resident=resident, activation_host_bytes=room, placement=decided.placement)
    result.largest_micro_batch = _largest_micro_batch(cfg, device, result)
    result.longest_context = longest_context(cfg, device, result)
    result.max_positions = cfg.model.max_position_embeddings
    result.notes += [activation_note(cfg, device, result), decided.pace.line(),
                     timeout_line(decided.pace, cfg.cluster.actor_timeout_s)]
    if cfg.lora.enabled:  # the adapters' fp32 master and moments; the frozen base is not written
        checkpoint_bytes = 12 * AdapterLayout.build(m, cfg.lora).num_params
    else:
        checkpoint_bytes = n_params * precision.master.itemsize + sum(
            store.numel(k) * store.dtype(k).itemsize for k in ("exp_avg", "exp_avg_sq", *_scale_kinds(store)))
    result.notes.append(_checkpoint_note(cfg, checkpoint_bytes))
    result.notes += mode_notes(cfg, device, host - (result.total("host") - store.nbytes()), resident)
    return result


def _scale_kinds(spec: StoreSpec) -> tuple[str, ...]:
    return tuple(k for k in spec.kinds() if k.endswith("_scale"))


def _store_label(spec: StoreSpec, kind: str) -> str:
    """A store row's label: its kind's, or a quantized base's format (lora.base_format)."""
    if kind == "master" and spec.lora.quantized:
        return f"frozen base, {spec.lora.base_format} (lora.base_format; embedding, head, norms in the compute dtype)"
    return _KIND_LABELS[kind]


def _checkpoint_note(cfg: TrainConfig, nbytes: int) -> str:
    """Disk a checkpoint takes against what train.run_dir has, and the pause it causes."""
    t = cfg.train
    where = cfg.train.run_dir
    while where and not os.path.exists(where):
        where = os.path.dirname(where.rstrip("/")) or "."
    free = shutil.disk_usage(where or ".").free
    keep = (t.keep_checkpoints + 1) * nbytes
    when = (f"every {t.checkpoint_every} steps, at the end" if t.checkpoint_every else
            "at the end before the export" if t.save_final and not cfg.lora.enabled else "")
    if not when:
        when = "only when interrupted" if t.checkpoint_on_interrupt else "none"
    else:
        when += " and when interrupted" if t.checkpoint_on_interrupt else ", not when interrupted"
    return (f"checkpoints: {fmt(nbytes)} each ({when}; up to {t.keep_checkpoints} kept + 1 being written = "
            f"{fmt(keep)}; {fmt(free)} free in train.run_dir{'' if keep <= free else ': NOT ENOUGH'}); "
            f"it is written while training goes on, but a unit's next update waits until its bytes are written, so "
            f"cluster.actor_timeout_s ({cfg.cluster.actor_timeout_s:.0f} s) must exceed its write time")


def _largest_micro_batch(cfg: TrainConfig, device: str, base: MemoryPlan) -> int | None:
    if device == "cpu":
        budget = base.host_available - (base.total("host") - base.total("device"))
    elif base.device_bytes is None:
        return None
    else:
        budget = int(base.device_bytes * GPU_USABLE)

    def fits(b: int) -> bool:
        return device_total(device_rows(cfg, device, b, base.device_bytes, base.resident,
                                        base.activation_host_bytes)) <= budget

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi) and hi < 2**24:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def check_init_from(cfg: TrainConfig) -> None:
    """train.init_from's weights: every tensor present, every shard readable, every shape right.

    Reads only the safetensors headers, so a missing, truncated or foreign checkpoint fails in
    milliseconds, before Ray starts, instead of in the store actor.
    """
    if cfg.train.init_from is not None:
        from ..io import bnb_checkpoint, hf_io

        if bnb_checkpoint.quantization(cfg.train.init_from) is not None:
            bnb_checkpoint.check(cfg)
        else:
            hf_io.check_weights(cfg.model, cfg.train.init_from, "train.init_from")
