"""Evaluation in this process on the CPU: logits, and loss / perplexity on held-out data.

The model runs layer-major over a group of sequences, like one training step without the
pipeline: :func:`megatrain_ray.model.transformer.forward_hidden` (the model's one whole-model forward)
embeds the group, runs each decoder layer in turn and the final norm; the loss is taken in token chunks.
Weights come one unit at a time from a :data:`UnitReader` (an HF-format directory read through
safetensors, or views of a host store), so evaluating a checkpoint needs one unit of weights and
the group's activations in memory, never the whole model.

Precision: weights are upcast to float32 and everything runs in float32.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from ..config import EXECUTION_SECTIONS, ModelConfig
from ..errors import DataError
from ..model.transformer import IGNORE_INDEX, UnitReader, forward_hidden, token_loss_sum
from . import hf_io
from .locate import resolve_checkpoint
from ..data.tokenizer import BYTE_LEVEL


def checkpoint_reader(directory: str) -> tuple[ModelConfig, UnitReader]:
    """The model config and a unit reader of an HF-format checkpoint directory (fp32 tensors)."""
    cfg, _ = hf_io.read_config(directory)
    mapping = hf_io.check_weights(cfg, directory, "the checkpoint")
    return cfg, lambda unit: hf_io.read_unit(directory, mapping, cfg, unit)


def store_reader(store) -> UnitReader:
    """A unit reader over a HostStore's master weights (fp32 copies)."""
    units = store.layout.units
    return lambda unit: {k: v.float() for k, v in store.params("master", units.index(unit)).items()}


@torch.inference_mode()
def forward_logits(cfg: ModelConfig, read: UnitReader, ids: torch.Tensor) -> torch.Tensor:
    """ids: [B, S] int64 -> logits [B, S, V] float32."""
    h, w = forward_hidden(cfg, read, ids)
    return torch.nn.functional.linear(h, w).float()


@torch.inference_mode()
def loss_sum(cfg: ModelConfig, read: UnitReader, ids: torch.Tensor, labels: torch.Tensor,
             chunk: int = 1024, position_ids: torch.Tensor | None = None) -> tuple[float, int]:
    """ids, labels: [B, S] int64 -> (summed cross-entropy over counted labels, number counted);
    position_ids [B, S]: packed documents (data.pack_documents), each attending within itself."""
    h, w = forward_hidden(cfg, read, ids, position_ids=position_ids)
    h, labels = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    total = sum(float(token_loss_sum(h[s:s + chunk], w, labels[s:s + chunk]))
                for s in range(0, h.shape[0], chunk))
    return total, int((labels != IGNORE_INDEX).sum())


@dataclass
class EvalResult:
    """Mean next-token loss over the counted tokens and its exponential."""

    loss: float
    perplexity: float
    tokens: int
    sequences: int


def evaluate(cfg: ModelConfig, read: UnitReader, batches: Iterable[dict[str, np.ndarray]],
             max_batches: int | None = None) -> EvalResult:
    """Loss and perplexity over ``batches`` (input_ids, labels and, for packed documents,
    position_ids: [..., S]; leading dims are flattened)."""
    total, count, seqs = 0.0, 0, 0
    for b, batch in enumerate(batches):
        if max_batches is not None and b >= max_batches:
            break
        ids = torch.as_tensor(batch["input_ids"], dtype=torch.long)
        labels = torch.as_tensor(batch["labels"], dtype=torch.long)
        ids, labels = ids.reshape(-1, ids.shape[-1]), labels.reshape(-1, labels.shape[-1])
        if int(ids.max()) >= cfg.vocab_size:
            raise DataError(f"the evaluation data holds token id {int(ids.max())}, outside the checkpoint's "
                              f"vocab_size ({cfg.vocab_size}); the data and the model do not match.")
        pos = batch.get("position_ids")  # packed documents: masked as in training
        pos = None if pos is None else torch.as_tensor(pos, dtype=torch.long).reshape(ids.shape)
        s, n = loss_sum(cfg, read, ids, labels, position_ids=pos)
        total, count, seqs = total + s, count + n, seqs + ids.shape[0]
    if count == 0:
        raise DataError("the evaluation data holds no counted tokens; check data.val_path / data.val_fraction.")
    loss = total / count
    return EvalResult(loss=loss, perplexity=math.exp(min(loss, 700.0)), tokens=count, sequences=seqs)


SECTIONS = ("model", "optim", "train", "data", *EXECUTION_SECTIONS)


def run_eval(src: str, config: str | None = None, overrides: list[str] = (), split: str = "val",
             batch_size: int = 8, max_batches: int | None = None, log=print, connect=None) -> EvalResult:
    """``megatrain-ray eval``: loss / perplexity of a run's (or checkpoint's) weights on its data.

    The data settings are the run's own (runs/<id>/config.json, or the checkpoint's meta.json),
    overridden by ``config`` and ``overrides``; the model is the checkpoint's config.json. The
    tokenizer is the run's (see :attr:`megatrain_ray.io.locate.Checkpoint.tokenizer`): byte-level for a
    byte-level run, else a tokenizer directory, the one saved next to the weights when the run's
    own is gone. With no data settings at all, the built-in corpus's held-out documents are read.
    ``connect``: how to reach Ray if the data must be tokenized first (see
    :data:`megatrain_ray.data.loader.Connect`).
    """
    from ..data.loader import source_from_config

    if split not in ("val", "train"):
        raise DataError(f"--split must be val or train, got {split!r}.")
    if batch_size <= 0 or (max_batches is not None and max_batches <= 0):
        raise DataError("--batch-size and --max-batches must be positive.")
    ckpt = resolve_checkpoint(src)
    model_cfg, read = checkpoint_reader(ckpt.weights_dir)
    base = {k: dict(v) for k, v in (ckpt.run_config or {}).items() if k in SECTIONS and isinstance(v, dict)}
    base.pop("model", None)
    base.setdefault("train", {})["init_from"] = None  # the weights are the checkpoint's
    tokenizer = ckpt.tokenizer
    if tokenizer not in (None, BYTE_LEVEL):
        base.setdefault("data", {})["tokenizer"] = tokenizer
    cfg = hf_io.load_train_config(config, list(overrides), base=base)
    cfg = dataclasses.replace(cfg, model=model_cfg).validate()
    source = source_from_config(cfg, split, log, connect)
    result = evaluate(model_cfg, read, source.eval_batches(batch_size), max_batches)
    log(f"eval: {split} loss {result.loss:.4f} | perplexity {result.perplexity:.3f} | "
        f"{result.tokens:,} tokens in {result.sequences:,} sequences | weights {ckpt.weights_dir}")
    return result
