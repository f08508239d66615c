"""The run's sections besides the model: optimizer, steps and batch shape, data (the sections of how
the run executes are in :mod:`.execution`, the lora section in :mod:`.lora`), and :class:`TrainConfig`,
which holds them all and checks the rules between them.

Every check raises :class:`~megatrain_ray.errors.ConfigError` with one sentence that names the key.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from .fields import require as _require
from .lora import PEFT_FUSED_MOE, LoraSection, mxfp4_refusal
from .host import unwritable, usable_cpus  # noqa: F401  (re-exported)
from .model import ModelConfig
from .execution import (AUTO_BUFFER_DEPTH, AUTO_LOSS_CHUNK_SIZE, AUTO_MLP_CHUNK, GRAD_REDUCE,  # noqa: F401  (re-exported)
                        ClusterSection, ComputeSection, ExperimentalSection, MemorySection, ParallelSection,
                        PrecisionSection)

LOGGERS = ("tensorboard", "mlflow", "wandb")
"""Values in train.loggers (the trackers of megatrain_ray.orchestration.trackers)."""


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with decoupled weight decay, global-norm clipping and a warmup + cosine schedule."""

    lr: float = 3e-3
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = 0.0
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 0
    """Steps of linear warmup from lr/warmup_steps to lr."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay, applied to matrices (embeddings, projections, LM head) and, with
    decay_norms_and_biases, to every parameter."""
    decay_norms_and_biases: bool = False
    """Also decay the 1-D parameters (RMSNorm weights, attention biases), as ``torch.optim.AdamW``
    does to every parameter it is given in one group; false keeps them undecayed, the usual LLM recipe."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    state: str = "fp32"
    """Optimizer state in host memory: fp32 (exact AdamW: fp32 moments, master in precision.master_dtype)
    or 8bit (compact, ~4 bytes per parameter plus the gradient: block-quantized 8-bit moments and bf16
    master weights, all rounded stochastically, whatever precision.master_dtype says; see
    megatrain_ray.engine.compact)."""
    placement: str = "host"
    """Where the AdamW update of each streamed unit runs: host (default: the gradient sink, on the
    host's CPU threads, from the gradient the compute worker sends) or device (the compute worker's
    device: the unit's gradient stays there, and after the step's norm its fp32 master weights and
    moments, or with optim.state 8bit its bf16 master weights, 8-bit codes and block scales, are copied
    in, updated with the same AdamW and written back to the host store, beside the next step's
    forward, so the host's CPUs update nothing; needs one compute worker and precision.master_dtype
    float32), or auto: a split from the plan's arithmetic (megatrain_ray.orchestration.placement): every unit
    on the host where the host's update of all of them does not lengthen the step, else units from
    the first the next forward needs on to the device, as many as give the shortest step (the host's
    AdamW rate per thread, exact or 8-bit, against each unit's state crossing the link beside that
    forward; with clipping, the host's updates run after the backward and the next forward follows
    them), each move weighed with the
    activations placed again beside the moved units' held gradients (recompute included), and while
    the plan's GPU total fits; all on the host where the device update cannot serve the run (the cpu device, bf16 master weights with the exact state,
    several compute workers, LoRA). ``plan`` prints where each unit's update runs. Units resident on
    the device (memory.resident) are updated there either way."""

    def validate(self) -> None:
        for key in ("lr", "min_lr", "beta1", "beta2", "eps", "weight_decay", "max_grad_norm"):
            _require(math.isfinite(getattr(self, key)), f"optim.{key}", f"must be finite, got {getattr(self, key)}")
        _require(self.lr > 0, "optim.lr", f"must be positive, got {self.lr}")
        _require(0 <= self.min_lr <= self.lr, "optim.min_lr", f"must be within [0, optim.lr], got {self.min_lr}")
        _require(self.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        _require(0 <= self.beta1 < 1, "optim.beta1", f"must be in [0, 1), got {self.beta1}")
        _require(0 <= self.beta2 < 1, "optim.beta2", f"must be in [0, 1), got {self.beta2}")
        _require(self.eps > 0, "optim.eps", f"must be positive, got {self.eps}")
        _require(self.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {self.weight_decay}")
        _require(self.max_grad_norm >= 0, "optim.max_grad_norm", f"must be >= 0, got {self.max_grad_norm}")
        _require(self.state in OPTIM_STATES, "optim.state",
                 f"must be one of {', '.join(OPTIM_STATES)}, got {self.state!r}")
        _require(self.placement in OPTIM_PLACEMENTS, "optim.placement",
                 f"must be one of {', '.join(OPTIM_PLACEMENTS)}, got {self.placement!r}")


OPTIM_STATES = ("fp32", "8bit")
"""Values of optim.state."""
OPTIM_PLACEMENTS = ("host", "device", "auto")
"""Values of optim.placement."""


def lr_at(cfg: OptimConfig, step: int, total_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then cosine to min_lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class TrainSection:
    """What the run starts from, how many steps, the shape of each step's batch, and what it writes."""

    init_from: str | None = None
    """A Hugging Face model directory (config.json + safetensors) to start from; None = random init."""
    steps: int = 60
    """Number of optimizer steps to run."""
    seq_len: int = 64
    """Tokens per sequence."""
    micro_batch_size: int = 8
    """Sequences per micro-batch."""
    num_micro_batches: int = 2
    """Micro-batches per optimizer step (gradient accumulation), processed layer-major."""
    seed: int = 0
    """Seed of weight initialisation and of the data order."""
    log_every: int = 1
    """Print a progress line every this many steps."""
    checkpoint_every: int = 100
    """Save a checkpoint (weights, AdamW states, step, data position, config) to <run dir>/checkpoints
    every this many steps and at the end of the run; 0 saves only when the run is interrupted
    (Ctrl-C, SIGTERM, ``ray job stop``; see checkpoint_on_interrupt) and, with save_final, at the end
    before the export."""
    checkpoint_on_interrupt: bool = True
    """Ctrl-C, SIGTERM or ``ray job stop`` finish the steps in flight and save a checkpoint at the
    boundary they reach before the run stops; false: the run stops at once and saves nothing (a
    benchmark or a throwaway experiment, whose weights are not worth the disk or the wait)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep; older ones are deleted once a newer one is complete."""
    checkpoint_staging_gib: float = 0.0
    """Host memory (GiB) the gradient sink may fill with copies of units that the checkpoint being
    written has not reached yet, so that their next update need not wait for the disk (see
    megatrain_ray/io/writer.py); 0: none, an update waits until its unit is written."""
    save_final: bool = True
    """Export the final weights to <run dir>/final (Hugging Face safetensors) at the end of the run."""
    eval_every: int = 0
    """Every this many steps, the validation loss of the model as it stands (after that many updates),
    on one step's worth of sequences from the validation split (data.val_fraction or data.val_path;
    the built-in corpus has its own), and at the run's last step (after train.steps - 1 updates:
    ``megatrain-ray eval`` gives the final weights'); it rides along the next step's forward, so no
    weights cross the link for it. 0 = never."""

    run_dir: str = "runs"
    """Directory where each run writes its config, metrics, checkpoints and final weights (in
    <run_dir>/<run id>). Relative paths are taken from the current directory, except in a Ray job,
    whose working directory is Ray's temporary copy: there from ~/megatrain-ray on the job's node."""
    loggers: tuple[str, ...] = ()
    """Experiment trackers that get every step's metrics (the Ray gauges' names) besides
    metrics.jsonl: any of tensorboard, mlflow (a local SQLite store), wandb (offline unless
    WANDB_MODE says otherwise), all writing into the run's directory; e.g. ``[tensorboard, mlflow]``.
    Their libraries are optional: ``pip install 'megatrain-ray[trackers]'``. See
    megatrain_ray.orchestration.trackers."""

    profile_steps: tuple[int, ...] = ()
    """Steps (numbered from 1, as the progress lines count them) that torch.profiler records on each
    compute worker, into <run dir>/profile/step-<n>/worker-<rank>: trace.json.gz, a Chrome trace of
    the step (Perfetto or chrome://tracing opens it: every kernel and copy on every GPU stream, the
    CPU operators), and kernels.txt, where the device's time went (busy and idle, the largest idle
    gaps, time by kind of kernel and by kernel, then torch's table of operators). A profiled step
    runs somewhat slower; its metrics row names its profile. E.g. ``[3]``: a step after the compiles."""

    def eval_due(self, step: int) -> bool:
        """Whether step ``step`` (0-based) carries the validation batch (see ``eval_every``)."""
        return self.eval_every > 0 and (step % self.eval_every == 0 or step == self.steps - 1)

    def validate(self) -> None:
        for key in ("steps", "seq_len", "micro_batch_size", "num_micro_batches", "log_every", "keep_checkpoints"):
            _require(getattr(self, key) > 0, f"train.{key}", f"must be positive, got {getattr(self, key)}")
        _require(self.seed >= 0, "train.seed", f"must be >= 0, got {self.seed}")
        _require(self.eval_every >= 0, "train.eval_every", f"must be >= 0 (0 = never), got {self.eval_every}")
        _require(self.checkpoint_every >= 0, "train.checkpoint_every",
                 f"must be >= 0 (0 = only on interrupt), got {self.checkpoint_every}")
        _require(all(1 <= n <= self.steps for n in self.profile_steps) and len(set(self.profile_steps)) == len(self.profile_steps),
                 "train.profile_steps", f"must be distinct step numbers from 1 to train.steps ({self.steps}), "
                 f"got {list(self.profile_steps)!r}")
        _require(self.checkpoint_staging_gib >= 0, "train.checkpoint_staging_gib",
                 f"must be >= 0 (0 = no staging copies), got {self.checkpoint_staging_gib}")
        _require(isinstance(self.loggers, tuple) and all(name in LOGGERS for name in self.loggers)
                 and len(set(self.loggers)) == len(self.loggers), "train.loggers",
                 f"must be a list of distinct names of {', '.join(LOGGERS)} (e.g. [tensorboard, mlflow]), "
                 f"got {list(self.loggers)!r}")
        _require(not os.path.exists(self.run_dir) or os.path.isdir(self.run_dir), "train.run_dir",
                 f"names a file, not a directory: {self.run_dir!r}")
        why = unwritable(self.run_dir)  # before anything is started or created, not at the first write
        _require(why is None, "train.run_dir", f"{self.run_dir!r} cannot be written to ({why})")
        if self.init_from is not None:
            _require(os.path.isfile(os.path.join(self.init_from, "config.json")), "train.init_from",
                     f"must be a Hugging Face model directory with a config.json, got {self.init_from!r}")


@dataclass(frozen=True)
class DataSection:
    """Where the training tokens come from and how they become batches (see megatrain_ray.data.datasets)."""

    path: str | None = None
    """A data file, or a directory of files of one kind: .txt, .jsonl/.json, .parquet, .arrow or .npy;
    None uses the built-in corpus (see builtin_document_tokens)."""
    builtin_document_tokens: int = 0
    """The built-in corpus's documents (data.path None; ignored when data.path names files): 0 reads its
    400 short ones (and 40 held out); N > 0 reads instead 8 long documents (and 1 held out) of at
    least N tokens each plus EOS (tokens of data.tokenizer), paragraphs of the same grammar generated
    on first use and tokenized into data.cache_dir: enough to fill sequences of train.seq_len <= N,
    each mostly one document. Read as text (data.format auto or text)."""
    format: str = "auto"
    """How to read data.path: windows (random windows over one byte-level .txt or 1-D .npy token
    stream, the original behaviour), text (documents tokenised, EOS-separated, packed into sequences),
    alpaca or sharegpt (chat SFT, loss on response tokens only), tokens (pre-tokenised input_ids:
    .npy, .arrow, .parquet, .jsonl), or auto: windows for the built-in corpus, one .txt or one 1-D .npy
    file (text or tokens instead when data.val_fraction holds part of it out), else by columns."""
    tokenizer: str | None = None
    """A local Hugging Face tokenizer directory; None uses train.init_from's tokenizer when it has
    one, else byte-level ids (256 bytes + EOS, model.vocab_size >= 260)."""
    text_key: str = "text"
    """The field holding each document's text in .jsonl/.json/.parquet rows (format text)."""
    val_path: str | None = None
    """Held-out data read like data.path (all of it is the validation split); None: see val_fraction."""
    val_fraction: float = 0.0
    """Share of data.path's documents held out for validation (chosen by a fixed hash of the document
    index, the same for every seed; the tail of a 1-D .npy token stream); 0 holds out none (the
    built-in corpus then validates on held-out documents of its own)."""
    cache_dir: str | None = None
    """Where tokenised data is cached, keyed by a fingerprint of files and tokenizer; None uses
    <train.run_dir>/data-cache."""
    num_workers: int = 1
    """Size of the tokenizer actor pool (Ray Data) and number of data-loader actors serving batches."""
    pack_documents: bool = False
    """Treat each sequence as a pack of separate documents: attention is masked at document
    boundaries (a token sees only earlier tokens of its own document), RoPE positions restart at 0
    for each document, and the token that ends one document is not trained to predict the next
    document's first token. Packed text (documents cut into sequences from the stream) keeps its
    layout and gains the boundaries; SFT examples (alpaca, sharegpt, tokens with labels) are packed
    several to a sequence, in corpus order, instead of one padded example each. Needs document
    boundaries: not available for a 1-D .npy token stream."""

    def validate(self) -> None:
        _require(self.num_workers > 0, "data.num_workers", f"must be positive, got {self.num_workers}")
        for key in ("path", "val_path"):
            path = getattr(self, key)
            if path is None:
                continue
            _require(os.path.exists(path), f"data.{key}", f"does not name a readable file or directory: {path!r}")
            _require(os.path.isdir(path) or path.endswith(_DATA_EXTENSIONS), f"data.{key}",
                     f"must be a .txt or .npy file, or a .jsonl, .json, .parquet or .arrow file (or a directory "
                     f"of them), got {path!r}")
        _require(self.format in _DATA_FORMATS, "data.format",
                 f"must be one of {', '.join(_DATA_FORMATS)}, got {self.format!r}")
        _require(0.0 <= self.val_fraction < 1.0, "data.val_fraction", f"must be in [0, 1), got {self.val_fraction}")
        _require(not (self.format == "windows" and self.val_fraction), "data.val_fraction",
                 "must be 0 with data.format windows, whose random windows span the whole stream; use "
                 "data.format auto, text or tokens to hold documents out, or data.val_path")
        _require(not (self.val_path and self.val_fraction), "data.val_fraction",
                 "must be 0 when data.val_path is set (the validation data is either held out or separate)")
        _require(bool(self.text_key), "data.text_key", "may not be empty")
        _require(self.builtin_document_tokens >= 0, "data.builtin_document_tokens",
                 f"must be 0 or positive, got {self.builtin_document_tokens}")
        _require(not self.builtin_document_tokens or self.path is not None or self.format in ("auto", "text"),
                 "data.builtin_document_tokens",
                 f"makes the built-in corpus long documents of text, which data.format {self.format} does not read; "
                 "use data.format text (or auto)")
        if self.tokenizer is not None:
            _require(os.path.isdir(self.tokenizer) and any(os.path.isfile(os.path.join(self.tokenizer, n)) for n in (
                "tokenizer.json", "tokenizer.model", "vocab.json")), "data.tokenizer",
                f"must be a Hugging Face tokenizer directory (with tokenizer.json), got {self.tokenizer!r}")


_DATA_EXTENSIONS = (".txt", ".npy", ".jsonl", ".json", ".parquet", ".arrow")
_DATA_FORMATS = ("auto", "windows", "text", "alpaca", "sharegpt", "tokens")


@dataclass(frozen=True)
class TrainConfig:
    """A whole run: model shape, optimizer, steps and batch shape, data, adapters, and how it executes.

    Frozen, as every section: a loaded config is never changed; a changed setting is a new value
    (``dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=...))``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape (ignored fields are replaced by train.init_from's config.json when set)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    train: TrainSection = field(default_factory=TrainSection)
    """Starting weights, steps and batch shape, checkpoints and where the run writes."""
    data: DataSection = field(default_factory=DataSection)
    """Training data."""
    lora: LoraSection = field(default_factory=LoraSection)
    """Low-rank adapters on a frozen base (off unless lora.rank > 0)."""
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    """Dtypes of the computation, the master weights and the gradients."""
    compute: ComputeSection = field(default_factory=ComputeSection)
    """Device and kernels."""
    memory: MemorySection = field(default_factory=MemorySection)
    """Weight slots, chunks, activations, resident units, the host store's directory."""
    parallel: ParallelSection = field(default_factory=ParallelSection)
    """Compute workers, nodes and the AdamW work."""
    cluster: ClusterSection = field(default_factory=ClusterSection)
    """Ray, its dashboard, timeouts and restarts."""
    experimental: ExperimentalSection = field(default_factory=ExperimentalSection)
    """Switches kept to measure one choice against another."""

    def sections(self) -> tuple:
        """Every section, in the order of the fields."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def validate(self) -> "TrainConfig":
        """Check every section and the cross-section rules; return self."""
        for section in self.sections():
            section.validate()
        _require(self.train.seq_len <= self.model.max_position_embeddings, "train.seq_len",
                 f"({self.train.seq_len}) exceeds model.max_position_embeddings "
                 f"({self.model.max_position_embeddings})")
        window = self.model.sliding_window
        _require(window is None or self.model.layer_types is not None or self.train.seq_len <= window, "train.seq_len",
                 f"({self.train.seq_len}) exceeds model.sliding_window ({window}); sliding-window attention "
                 "is not implemented, so shorter sequences are needed")
        _require(not self.train.eval_every or self.data.val_fraction > 0 or self.data.val_path
                 or self.data.path is None, "train.eval_every",
                 "needs validation data: set data.val_fraction (held out of data.path) or data.val_path")
        mem, par, layers = self.memory, self.parallel, self.model.num_hidden_layers
        if mem.activations == "counts":
            counts = (mem.kept_layers, mem.offloaded_layers, mem.spanned_layers)
            _require(sum(counts) <= layers, "memory.activations",
                     f"(counts: {mem.kept_layers} kept, {mem.offloaded_layers} offloaded, {mem.spanned_layers} "
                     f"spanned) places more layers than the model has ({layers})")
            _require(not mem.spanned_layers or mem.kept_layers + mem.spanned_layers < layers, "memory.spanned_layers",
                     f"({mem.spanned_layers}) leaves no checkpoint for a recompute span to start from; keep or span "
                     "fewer layers")
        _require(self.train.num_micro_batches % par.workers == 0, "train.num_micro_batches",
                 f"({self.train.num_micro_batches}) must be a multiple of the compute workers of all nodes "
                 f"({par.compute_workers} x {par.nodes}), so each takes an equal share")
        _require(self.experimental.grad_reduce != "host" or par.nodes == 1, "experimental.grad_reduce",
                 f"host needs parallel.nodes=1 (got {par.nodes}): it sums the gradients of one node's workers in "
                 "that node's host memory; use allreduce across nodes")
        if mem.resident == "embed_head":
            setting = f"embed_head, {mem.resident_layers} layers"
            _require(par.workers == 1, "memory.resident",
                     f"({setting}) needs one compute worker in the whole run (got {par.compute_workers} x "
                     f"{par.nodes}): each would update its own copy; set it to none")
            _require(mem.resident_layers <= layers, "memory.resident_layers",
                     f"({mem.resident_layers}) names more decoder layers than the model has ({layers})")
            _require(self.precision.master_dtype == "float32" and self.optim.state == "fp32", "memory.resident",
                     f"({setting}) needs fp32 master weights and moments (precision.master_dtype "
                     f"{self.precision.master_dtype}, optim.state {self.optim.state}); set it to none")
        _require(not (self.lora.train_head and self.model.tie_word_embeddings), "lora.train_head",
                 "cannot be set for a model with tied embeddings (model.tie_word_embeddings), whose LM head is the "
                 "embedding: set lora.train_embedding to train both")
        _require(not (self.optim.decay_norms_and_biases and self.model.router_scoring == "sigmoid"),
                 "optim.decay_norms_and_biases",
                 f"cannot be set for a {self.model.model_type} model: weight decay would move its routers' "
                 "score-correction biases (mlp.gate.e_score_correction_bias), which are held frozen; set it to false")
        if self.optim.placement == "device":
            self._validate_device_updates(par)
        if self.lora.enabled:
            self._validate_lora(par.workers)
        _require(self.optim.warmup_steps <= self.train.steps, "optim.warmup_steps",
                 f"({self.optim.warmup_steps}) exceeds train.steps ({self.train.steps})")
        return self

    def _validate_device_updates(self, par) -> None:
        """What optim.placement device does not combine with, each in one sentence naming the key."""
        _require(self.precision.master_dtype == "float32", "optim.placement",
                 f"device needs fp32 master weights (precision.master_dtype {self.precision.master_dtype}); set "
                 "optim.placement host")
        _require(par.workers == 1, "optim.placement",
                 f"device needs one compute worker in the whole run (got {par.compute_workers} x {par.nodes}): each "
                 "would update its own copy; set optim.placement host")
        _require(not self.lora.enabled, "optim.placement",
                 f"device has nothing to place with lora.rank {self.lora.rank}: the base is frozen and the adapters "
                 "train on the device anyway; set optim.placement host")

    def _validate_lora(self, workers: int) -> None:
        """What a LoRA run (lora.rank > 0) does not combine with yet, each named by its key."""
        rank = self.lora.rank
        _require(self.parallel.nodes == 1, "parallel.nodes",
                 f"must be 1 with lora.rank {rank} (got {self.parallel.nodes}): a LoRA run's compute workers share one "
                 "node")
        _require(workers == 1 or self.experimental.grad_reduce == "allreduce", "experimental.grad_reduce",
                 f"must be allreduce with lora.rank {rank} and {workers} compute workers (got "
                 f"{self.experimental.grad_reduce!r}): the adapters' gradients are summed on the devices")
        _require(self.memory.resident in ("auto", "none"), "memory.resident",
                 f"must be none with lora.rank {rank}: the frozen base has no optimizer, the adapters train on "
                 "the device anyway")
        _require(self.optim.state == "fp32", "optim.state",
                 f"must be fp32 with lora.rank {rank}: the adapters' AdamW state is exact fp32 on the device")
        sparse = bool(self.model.sparse_layers)
        _require(sparse or not self.lora.train_router, "lora.train_router",
                 "needs a mixture of experts (a model with sparse layers, model.num_experts > 0); set it to false")
        mlp = [m for m in self.lora.target_modules if m in ("gate_proj", "up_proj", "down_proj")]
        dense = [i for i in range(self.model.num_hidden_layers) if not self.model.is_sparse(i)]
        _require(not (sparse and dense and mlp and self.model.model_type in PEFT_FUSED_MOE), "lora.target_modules",
                 f"names {', '.join(mlp)}, which on a {self.model.model_type} model PEFT reads as its routed experts' "
                 f"parameters, so the adapters of its dense MLP layers ({', '.join(map(str, dense))}) would not load "
                 "in PEFT; target the attention projections (q_proj,k_proj,v_proj,o_proj) and the experts through "
                 "lora.target_experts")
        _require(not (sparse and mlp and self.model.model_type in PEFT_FUSED_MOE and self.model.shared_expert_size),
                 "lora.target_modules",
                 f"names {', '.join(mlp)}, which on a {self.model.model_type} model PEFT reads as its routed experts' "
                 "parameters, so the adapters of its shared experts would not load in PEFT; target the attention "
                 "projections (q_proj,k_proj,v_proj,o_proj) and the experts through lora.target_experts")
        _require(self.model.model_type != "gpt_oss" or not self.lora.train_router, "lora.train_router",
                 "must be false on a gpt_oss model: its router (mlp.router) carries a bias, which PEFT's "
                 "modules_to_save would train with its weight; train the adapters alone")
        refusal = mxfp4_refusal(self.model) if self.lora.base_format == "mxfp4" else None
        _require(refusal is None, "lora.base_format", refusal or "")
        _require(not (sparse and self.lora.dropout), "lora.dropout",
                 f"must be 0 on a mixture of experts (got {self.lora.dropout}): PEFT's adapters on the experts' fused "
                 "parameters (target_parameters) take no dropout, so the adapters would not load in PEFT")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
