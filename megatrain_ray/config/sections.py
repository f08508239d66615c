"""The run's sections besides the model: optimizer, steps and batch shape, data (the runtime section is in
:mod:`.runtime`, the lora section in :mod:`.lora`), and :class:`TrainConfig`, which holds all six and
checks the rules between them.

Every check raises :class:`~megatrain_ray.errors.ConfigError` with one sentence that names the key.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from .fields import require as _require
from .lora import LoraSection
from .host import unwritable, usable_cpus  # noqa: F401  (re-exported)
from .model import ModelConfig
from .runtime import (AUTO_BUFFER_DEPTH, AUTO_LOSS_CHUNK_SIZE, AUTO_MLP_CHUNK, GRAD_REDUCE,  # noqa: F401  (re-exported)
                      RuntimeSection, device_adamw_layers, parse_activation_counts)


@dataclass
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
    """Optimizer state in host memory: fp32 (exact AdamW: fp32 moments, master in runtime.master_dtype)
    or 8bit (compact, ~4 bytes per parameter plus the gradient: block-quantized 8-bit moments and bf16
    master weights, all rounded stochastically, whatever runtime.master_dtype says; see
    megatrain_ray.engine.compact)."""

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


OPTIM_STATES = ("fp32", "8bit")
"""Values of optim.state."""


def lr_at(cfg: OptimConfig, step: int, total_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then cosine to min_lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


@dataclass
class TrainSection:
    """How many steps, and the shape of each step's batch."""

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
    (Ctrl-C, SIGTERM, ``ray job stop``) and, with save_final, at the end before the export."""
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
    the built-in corpus has its own);
    it rides along the next step's forward, so no weights cross the link for it. 0 = never."""

    def eval_due(self, step: int) -> bool:
        """Whether step ``step`` carries the validation batch (see ``eval_every``)."""
        return self.eval_every > 0 and step % self.eval_every == 0

    def validate(self) -> None:
        for key in ("steps", "seq_len", "micro_batch_size", "num_micro_batches", "log_every", "keep_checkpoints"):
            _require(getattr(self, key) > 0, f"train.{key}", f"must be positive, got {getattr(self, key)}")
        _require(self.seed >= 0, "train.seed", f"must be >= 0, got {self.seed}")
        _require(self.eval_every >= 0, "train.eval_every", f"must be >= 0 (0 = never), got {self.eval_every}")
        _require(self.checkpoint_every >= 0, "train.checkpoint_every",
                 f"must be >= 0 (0 = only on interrupt), got {self.checkpoint_every}")
        _require(self.checkpoint_staging_gib >= 0, "train.checkpoint_staging_gib",
                 f"must be >= 0 (0 = no staging copies), got {self.checkpoint_staging_gib}")


@dataclass
class DataSection:
    """Where the training tokens come from and how they become batches (see megatrain_ray.data.datasets)."""

    path: str | None = None
    """A data file, or a directory of files of one kind: .txt, .jsonl/.json, .parquet, .arrow or .npy;
    None uses the built-in corpus."""
    format: str = "auto"
    """How to read data.path: windows (random windows over one byte-level .txt or 1-D .npy token
    stream, the original behaviour), text (documents tokenised, EOS-separated, packed into sequences),
    alpaca or sharegpt (chat SFT, loss on response tokens only), tokens (pre-tokenised input_ids:
    .npy, .arrow, .parquet, .jsonl), or auto: windows for the built-in corpus, one .txt or one 1-D .npy
    file (text or tokens instead when data.val_fraction holds part of it out), else by columns."""
    tokenizer: str | None = None
    """A local Hugging Face tokenizer directory; None uses runtime.init_from's tokenizer when it has
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
    <runtime.run_dir>/data-cache."""
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
        if self.tokenizer is not None:
            _require(os.path.isdir(self.tokenizer) and any(os.path.isfile(os.path.join(self.tokenizer, n)) for n in (
                "tokenizer.json", "tokenizer.model", "vocab.json")), "data.tokenizer",
                f"must be a Hugging Face tokenizer directory (with tokenizer.json), got {self.tokenizer!r}")


_DATA_EXTENSIONS = (".txt", ".npy", ".jsonl", ".json", ".parquet", ".arrow")
_DATA_FORMATS = ("auto", "windows", "text", "alpaca", "sharegpt", "tokens")


@dataclass
class TrainConfig:
    """A whole run: model shape, optimizer, batch shape, data and runtime."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape (ignored fields are replaced by runtime.init_from's config.json when set)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    train: TrainSection = field(default_factory=TrainSection)
    """Steps and batch shape."""
    data: DataSection = field(default_factory=DataSection)
    """Training data."""
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    """Device, precision, buffering and Ray."""
    lora: LoraSection = field(default_factory=LoraSection)
    """Low-rank adapters on a frozen base (off unless lora.rank > 0)."""

    def validate(self) -> "TrainConfig":
        """Check every section and the cross-section rules; return self."""
        for section in (self.model, self.optim, self.train, self.data, self.runtime, self.lora):
            section.validate()
        _require(self.train.seq_len <= self.model.max_position_embeddings, "train.seq_len",
                 f"({self.train.seq_len}) exceeds model.max_position_embeddings "
                 f"({self.model.max_position_embeddings})")
        window = self.model.sliding_window
        _require(window is None or self.train.seq_len <= window, "train.seq_len",
                 f"({self.train.seq_len}) exceeds model.sliding_window ({window}); sliding-window attention "
                 "is not implemented, so shorter sequences are needed")
        _require(not self.train.eval_every or self.data.val_fraction > 0 or self.data.val_path
                 or self.data.path is None, "train.eval_every",
                 "needs validation data: set data.val_fraction (held out of data.path) or data.val_path")
        counts = parse_activation_counts(self.runtime.activations)
        _require(counts is None or sum(counts) <= self.model.num_hidden_layers, "runtime.activations",
                 f"({self.runtime.activations!r}) keeps, offloads and spans more layers than the model has "
                 f"({self.model.num_hidden_layers})")
        _require(counts is None or not counts[2] or counts[0] + counts[2] < self.model.num_hidden_layers,
                 "runtime.activations", f"({self.runtime.activations!r}) leaves no checkpoint for a recompute span to "
                 "start from; keep or span fewer layers")
        workers = self.runtime.compute_workers * self.runtime.nodes
        _require(self.train.num_micro_batches % workers == 0, "train.num_micro_batches",
                 f"({self.train.num_micro_batches}) must be a multiple of the compute workers of all nodes "
                 f"({self.runtime.compute_workers} x {self.runtime.nodes}), so each takes an equal share")
        if self.runtime.device_adamw not in ("auto", "none"):
            _require(workers == 1, "runtime.device_adamw",
                     f"({self.runtime.device_adamw}) needs one compute worker in the whole run (got "
                     f"{self.runtime.compute_workers} x {self.runtime.nodes}): each would update its own copy; "
                     "set it to none")
            _require(device_adamw_layers(self.runtime.device_adamw) <= self.model.num_hidden_layers,
                     "runtime.device_adamw", f"({self.runtime.device_adamw}) names more decoder layers than the "
                     f"model has ({self.model.num_hidden_layers})")
            _require(self.runtime.master_dtype == "float32" and self.optim.state == "fp32", "runtime.device_adamw",
                     f"({self.runtime.device_adamw}) needs fp32 master weights and moments (runtime.master_dtype "
                     f"{self.runtime.master_dtype}, optim.state {self.optim.state}); set it to none")
        _require(not (self.lora.train_head and self.model.tie_word_embeddings), "lora.train_head",
                 "cannot be set for a model with tied embeddings (model.tie_word_embeddings), whose LM head is the "
                 "embedding: set lora.train_embedding to train both")
        if self.lora.enabled:
            self._validate_lora(workers)
        _require(self.optim.warmup_steps <= self.train.steps, "optim.warmup_steps",
                 f"({self.optim.warmup_steps}) exceeds train.steps ({self.train.steps})")
        return self

    def _validate_lora(self, workers: int) -> None:
        """What a LoRA run (lora.rank > 0) does not combine with yet, each named by its key."""
        rank = self.lora.rank
        _require(not (self.lora.train_embedding or self.lora.train_head),
                 "lora.train_embedding" if self.lora.train_embedding else "lora.train_head",
                 f"is not trained yet with adapters (lora.rank {rank}); set it to false")
        _require(workers == 1, "runtime.compute_workers",
                 f"must be 1 in the whole run with lora.rank {rank} (got {self.runtime.compute_workers} x "
                 f"{self.runtime.nodes}): the adapters live on one compute worker's device")
        _require(self.runtime.device_adamw in ("auto", "none"), "runtime.device_adamw",
                 f"must be none with lora.rank {rank}: the frozen base has no optimizer, the adapters train on "
                 "the device anyway")
        _require(self.optim.state == "fp32", "optim.state",
                 f"must be fp32 with lora.rank {rank}: the adapters' AdamW state is exact fp32 on the device")
        _require(not self.model.sparse_layers, "lora.rank",
                 f"({rank}) cannot be combined with a mixture of experts (model.num_experts "
                 f"{self.model.num_experts}) yet: adapters on the experts' projections are not built; set lora.rank 0")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
