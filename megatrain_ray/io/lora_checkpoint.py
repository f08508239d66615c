"""Checkpoints of a LoRA run: the adapters and their AdamW state, the frozen base left out.

The base of a LoRA run never changes, so a checkpoint need not hold it: resuming loads it again
from where the run took it (``train.init_from``, or train.seed's draw). A checkpoint directory
has the layout and checks of every checkpoint (:mod:`.checkpoint`: ``step-NNNNNN``, checksummed
files, ``meta.json`` last, found by :func:`~megatrain_ray.io.checkpoint.latest` and checked by
:func:`~megatrain_ray.io.checkpoint.check_files`), with other contents::

    model.safetensors.index.json + model-0000k-of-0000n.safetensors
        the adapters' fp32 master weights (and the embedding / LM head trained in full), by PEFT's key names
    optimizer.safetensors.index.json + optimizer-....safetensors
        their AdamW moments, ``exp_avg.<key>`` and ``exp_avg_sq.<key>`` (fp32)
    adapter_config.json                  the adapters' PEFT LoraConfig
    meta.json                            as every checkpoint's, its versions those of the adapter units,
                                         with ``lora``: the run's lora section

Written by the compute worker that holds the adapters, at the boundary, from copies of them on the
host (a few hundred MB at most); resume copies them back bit for bit.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from ..config import LoraSection, ModelConfig
from ..errors import CheckpointError, ConfigError
from ..model.lora import AdapterLayout, peft_name
from .checkpoint import (META_FILE, MODEL_INDEX, OPTIM_INDEX, CheckpointSettings, check_files, check_model, meta_checksum,
                         prune, read_meta, step_dir_name)
from .files import TensorSource, atomic_dir, write_json, write_shards
from .peft_io import ADAPTER_CONFIG, adapter_config
from .writer import step_meta

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
"""What a checkpoint holds of each adapter unit: its fp32 master weights and both AdamW moments."""

AdapterStates = dict[str, dict[str, torch.Tensor]]
"""unit -> {kind of :data:`STATE_KINDS`: [numel] fp32 on the CPU}."""


def _key(kind: str, key: str) -> str:
    return key if kind == "master" else f"{kind}.{key}"


def _tensors(layout: AdapterLayout, states: AdapterStates, kinds: tuple[str, ...]) -> list[TensorSource]:
    return [TensorSource.of(_key(kind, peft_name(unit, name)), view)
            for unit, template in layout.trained for kind in kinds
            for name, view in template.bind(states[unit][kind]).items()]


def save(checkpoints: CheckpointSettings, step: int, cfg: ModelConfig, lora: LoraSection, states: AdapterStates) -> str:
    """Write the checkpoint of boundary ``step`` (the adapters after ``step`` updates) into
    ``checkpoints.directory``, then prune to ``checkpoints.keep``; returns its path (nothing is written if this
    boundary was saved already)."""
    layout = AdapterLayout.build(cfg, lora)
    final = os.path.join(checkpoints.directory, step_dir_name(step))
    if not os.path.isdir(final):
        model, optim = _tensors(layout, states, STATE_KINDS[:1]), _tensors(layout, states, STATE_KINDS[1:])
        meta = step_meta(checkpoints, step, dict.fromkeys((u for u, _ in layout.trained), step), cfg,
                         {"master": "float32", "optim_state": "float32"})
        meta["lora"] = dataclasses.asdict(lora)
        os.makedirs(checkpoints.directory, exist_ok=True)
        with atomic_dir(final, "the checkpoint", sum(t.nbytes for t in model + optim)) as tmp:
            records = {**write_shards(tmp, "model", MODEL_INDEX, model, 2**62)[1],
                       **write_shards(tmp, "optimizer", OPTIM_INDEX, optim, 2**62)[1]}
            records[ADAPTER_CONFIG] = write_json(os.path.join(tmp, ADAPTER_CONFIG), adapter_config(cfg, lora))
            meta["files"] = {name: rec.to_dict() for name, rec in sorted(records.items())}
            meta["meta_crc32"] = meta_checksum(meta)
            write_json(os.path.join(tmp, META_FILE), meta)
        prune(checkpoints.directory, checkpoints.keep)
    return final


def check_adapters(meta: dict, lora: LoraSection, directory: str) -> None:
    """One ConfigError if checkpoint ``directory`` (its ``meta``) cannot be resumed with the run's
    ``lora`` section: adapters into a run without them (lora.rank 0), a full fine-tuning checkpoint
    into a LoRA run, or other adapters (rank, alpha, target modules, ...) than it holds. Checked when
    the resume is read, before Ray starts and the data is read."""
    saved = meta.get("lora")
    if saved is not None and not lora.enabled:
        raise ConfigError(f"checkpoint {directory} holds LoRA adapters (lora.rank {saved.get('rank')}), not a full "
                          "model, and the run has lora.rank 0; resume it without changing lora.*, or export it "
                          "(`megatrain-ray export`, the base with the adapters merged) and start a run from that "
                          "with train.init_from.")
    if not lora.enabled:
        return
    if saved is None:
        raise ConfigError(f"checkpoint {directory} is a full fine-tuning checkpoint, not a LoRA run's; resume it "
                          f"with lora.rank 0, or start a LoRA run from its weights with train.init_from={directory}.")
    ours = dataclasses.asdict(lora)
    diffs = [f"{k} {saved.get(k)!r} vs {v!r}" for k, v in ours.items() if k in saved and
             (list(saved[k]) if isinstance(v, tuple) else saved[k]) != (list(v) if isinstance(v, tuple) else v)]
    if diffs:
        raise ConfigError(f"checkpoint {directory} holds other adapters than the run's lora section "
                          f"({'; '.join(diffs)}); resume without changing lora.*.")


def load(directory: str, cfg: ModelConfig, lora: LoraSection) -> tuple[int, AdapterStates]:
    """(step, the adapters' states) of a LoRA checkpoint, after checking that it holds ``lora``'s
    adapters of ``cfg``'s model at one boundary; tensors are read one at a time."""
    from safetensors import safe_open

    meta = read_meta(directory)
    check_model(meta, cfg, directory)
    check_adapters(meta, lora, directory)
    layout = AdapterLayout.build(cfg, lora)
    step = meta["step"]
    if meta.get("versions") != dict.fromkeys((u for u, _ in layout.trained), step):
        raise CheckpointError(f"checkpoint {directory} has adapter versions {meta.get('versions')} that are not all "
                              f"its step {step}; it was not taken at a step boundary.")
    files = check_files(directory, checksums=False)  # the driver verified them (pipeline.train)
    states = {unit: {kind: torch.zeros(t.numel) for kind in STATE_KINDS} for unit, t in layout.trained}
    for unit, template in layout.trained:
        for kind in STATE_KINDS:
            for name, view in template.bind(states[unit][kind]).items():
                key = _key(kind, peft_name(unit, name))
                if key not in files or files[key][1] != tuple(view.shape):
                    raise CheckpointError(f"checkpoint {directory} lacks the tensor {key} of shape "
                                          f"{tuple(view.shape)}.")
                with safe_open(os.path.join(directory, files[key][0]), framework="pt") as f:
                    view.copy_(f.get_tensor(key))
    return step, states
