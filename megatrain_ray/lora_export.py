"""``megatrain-ray export`` of a LoRA run's checkpoint: the base with the adapters merged in, and the adapters.

A LoRA checkpoint holds the adapters alone (:mod:`megatrain_ray.io.lora_checkpoint`); the base is
where the run took it (``train.init_from``, or train.seed's draw). The export rebuilds what the run's
compute worker held at that step, in this process, without Ray: the base in a host store (as the run
loaded it, in the run's compute dtype) and the adapters from the checkpoint, then writes them as the
run's own end does (:meth:`~megatrain_ray.engine.compute.adapters.DeviceAdapters.export`): ``OUT`` is a
Hugging Face model directory of the merged weights (``from_pretrained`` loads it), ``OUT/adapter``
the PEFT adapter directory (``PeftModel.from_pretrained`` loads it on top of the base).
"""

from __future__ import annotations

import json
import os
import uuid

import torch

from .data.datasets import run_tokenizer
from .engine.compute.adapters import DeviceAdapters
from .engine.store.host_store import ParameterStore, StoreSpec
from .errors import ConfigError
from .io import checkpoint, run_lock
from .io.hf_io import DTYPES
from .io.locate import is_weights_dir
from .io.resume import resume_config
from .model.precision import resolve_precision

ADAPTER_DIR = "adapter"
"""Where the adapters go, inside the export's directory."""


def lora_checkpoint_of(src: str) -> str | None:
    """The LoRA checkpoint ``src`` means for an export, or None where it is another thing: ``src`` itself
    (a checkpoint whose meta.json has a lora section), or a run directory without final weights whose
    newest checkpoint is a LoRA one."""
    candidates = [src]
    if os.path.isdir(os.path.join(src, "checkpoints")) and not is_weights_dir(os.path.join(src, "final")):
        candidates += [d for _, d in reversed(checkpoint.step_dirs(os.path.join(src, "checkpoints")))][:1]
    for path in candidates:
        try:
            with open(os.path.join(path, checkpoint.META_FILE)) as f:
                if "lora" in json.load(f):
                    return path
        except (OSError, ValueError, TypeError):
            continue
    return None


def export_lora(directory: str, out: str, shard_bytes: int, dtype: str | None = None,
                tokenizer: str | None = None) -> dict:
    """Write LoRA checkpoint ``directory`` as the merged model at ``out`` and its adapters at
    ``out/adapter`` (see the module docstring); returns a summary as :func:`~megatrain_ray.io.hf_io.export`'s."""
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError(f"--out {out!r} exists and is not an empty directory; choose a new directory.")
    cfg, directory, _ = resume_config(directory, None, [], log=lambda line: None)  # the run's config, checked
    checkpoint.check_files(directory)
    run_device = _run_device(directory)
    precision = resolve_precision(cfg.precision, run_device, cfg.optim.state)
    spec = StoreSpec.of_run(cfg, precision, run_device, os.getpid(), "export-" + uuid.uuid4().hex[:6])
    store = ParameterStore(spec, cfg.train.seed, cfg.train.init_from)  # the base, as the run loaded it
    try:
        adapters = DeviceAdapters(store.store, cfg.train.seed, torch.device("cpu"), cfg.optim, cfg.train.steps,
                                  resume_from=directory)
        try:
            tok = tokenizer or run_tokenizer(cfg.to_dict()["data"], cfg.train.init_from)
            target = DTYPES[dtype] if dtype else spec.precision.master
            adapter_dir = os.path.join(out, ADAPTER_DIR)
            shards = adapters.export(adapter_dir, out, tok, cfg.train.init_from, dtype=target, shard_bytes=shard_bytes)
        finally:
            adapters.close()
    finally:
        store.close()
    return {"out": out, "source": directory, "adapter": adapter_dir, "shards": len(shards),
            "dtype": str(target).removeprefix("torch.")}


def _run_device(directory: str) -> str:
    """cpu or cuda: the device the checkpoint's run trained on (its run's config.json), whose compute
    dtype its base was held in; cpu where unknown."""
    try:
        with open(os.path.join(run_lock.run_of(directory), "config.json")) as f:
            device = json.load(f).get("device")
    except (OSError, ValueError, AttributeError):
        return "cpu"
    return device if device in ("cpu", "cuda") else "cpu"

