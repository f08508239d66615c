"""Where a run's (or a checkpoint's) Hugging Face-format weights are: :func:`resolve_checkpoint`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..config.moved import saved_run_config
from ..data.tokenizer import BYTE_LEVEL, is_tokenizer_dir
from ..errors import ConfigError
from . import checkpoint

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class Checkpoint:
    """Where a run's (or a checkpoint's) HF-format weights are, and the run's config if known."""

    weights_dir: str
    run_config: dict | None
    """The TrainConfig dict of the run that wrote it (runs/<id>/config.json), when there is one."""

    @property
    def tokenizer(self) -> str | None:
        """The tokenizer of these weights: the one the run's config names (its directory or BYTE_LEVEL,
        see :func:`megatrain_ray.data.datasets.run_tokenizer`) while that is still there, else the tokenizer
        files next to the weights, else None (unknown)."""
        from ..data.datasets import run_tokenizer

        run = self.run_config
        named = run and run_tokenizer(run.get("data") or {}, (run.get("train") or {}).get("init_from"))
        if named == BYTE_LEVEL or is_tokenizer_dir(named):
            return named
        return self.weights_dir if is_tokenizer_dir(self.weights_dir) else None


def resolve_checkpoint(path: str) -> Checkpoint:
    """A run directory (runs/<id>: its final/, else its newest checkpoints/step-*) or a directory of
    HF-format weights (a final/, a training checkpoint, any HF model directory). A training
    checkpoint is checked first, checksums included (:func:`megatrain_ray.io.checkpoint.check_files`):
    weights whose bytes changed on disk are refused, not exported or evaluated."""
    if not os.path.isdir(path):
        raise ConfigError(f"{path!r} is not a directory; pass a run directory (runs/<run id>) or a "
                          "checkpoint directory holding config.json and *.safetensors.")
    if not is_weights_dir(path):
        steps = [d for _, d in reversed(checkpoint.step_dirs(os.path.join(path, "checkpoints")))]
        found = next((c for c in [os.path.join(path, "final"), *steps] if is_weights_dir(c)), None)
        if found is None:
            raise ConfigError(f"{path!r} is neither a run directory (with final/ or checkpoints/step-*) nor a "
                              "checkpoint directory (config.json and model*.safetensors); did the run save any?")
        path = found
    weights = os.path.abspath(path)
    if os.path.isfile(os.path.join(weights, checkpoint.META_FILE)):
        checkpoint.check_files(weights)
    elif os.path.isfile(os.path.join(weights, checkpoint.OPTIM_INDEX)):  # a training checkpoint, by its files
        raise ConfigError(f"checkpoint {weights} has no {checkpoint.META_FILE}, so it is incomplete or damaged "
                          "and its weights cannot be verified; use another checkpoint of the run, or its final/.")
    up = os.path.dirname(weights)
    run = (_run_config(os.path.join(weights, "meta.json"), key="config")
           or _run_config(os.path.join(up, "config.json"))
           or _run_config(os.path.join(os.path.dirname(up), "config.json")))
    return Checkpoint(weights, run)


def is_weights_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and (
        os.path.isfile(os.path.join(path, INDEX_FILE)) or os.path.isfile(os.path.join(path, SINGLE_FILE)))


def _run_config(path: str, key: str | None = None) -> dict | None:
    """The TrainConfig dict at ``path`` (or under ``key`` in it), or None if absent or not a run's config."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if key is not None:
        data = data.get(key) if isinstance(data, dict) else None
    return saved_run_config(data)
