"""Training checkpoints: one flat, layout-independent directory per step boundary, written atomically.

A checkpoint holds everything a run needs to continue bit for bit::

    <run dir>/checkpoints/step-000300/
        config.json                        HF config of the model (the directory loads in transformers)
        model.safetensors.index.json       {"weight_map": {HF tensor name: shard file}}
        model-00001-of-00002.safetensors   master weights, full HF names, master dtype
        optimizer.safetensors.index.json   {"weight_map": {"exp_avg.<HF name>" / "exp_avg_sq.<HF name>": shard}}
        optimizer-00001-of-00003.safetensors   AdamW moments, fp32
        meta.json                          step, unit versions, data position, RNG, run config, format version

Nothing in it depends on how the store lays units out (padding, alignment, unit order): tensors
are found by name, so a checkpoint loads into any later layout of the same model, and the weights
part is itself a Hugging Face checkpoint (usable as ``runtime.init_from`` or by ``transformers``).

**Consistency.** A checkpoint is taken at a *step boundary*: every unit has received exactly
``step`` updates and none has started its next one. The gradient sink takes the periodic ones at
the top of its step loop (all updates of the previous step are done, none of this step's has
begun); gradients of the step keep arriving in the grad queue meanwhile, so the compute worker is
not stopped: it stalls only if the save outlasts one step of compute. On an interrupt the driver
stops submitting steps, lets the pipeline finish those in flight, and has the store actor save.
:func:`save` checks that every unit's version equals ``step`` before writing anything.

**Atomicity.** Files are written into a hidden ``.step-000300.tmp-<pid>-<random>`` directory next
to the final one, fsynced, ``meta.json`` last; then the directory is renamed into place (atomic on
one filesystem) and the parent fsynced. A crash or a full disk at any point leaves at most a
temporary directory, which readers ignore and the next save removes; older checkpoints are pruned
(keep-last-K) only after a new one is complete.

**Upgrades.** ``meta.json`` carries ``format_version``; :data:`_UPGRADES` turns an older meta dict
into the next version's, so old checkpoints keep loading after the format changes.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from ..errors import CheckpointError, ConfigError
from ..model.transformer import hf_name

FORMAT = "megatrain-ray-checkpoint"
FORMAT_VERSION = 1
META_FILE = "meta.json"
MODEL_INDEX = "model.safetensors.index.json"
OPTIM_INDEX = "optimizer.safetensors.index.json"
OPTIM_KINDS = ("exp_avg", "exp_avg_sq")
SHARD_BYTES = 2 * 2**30
_STEP_DIR = re.compile(r"^step-(\d+)$")
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}

_UPGRADES: dict[int, Callable[[dict], dict]] = {}
"""format_version n -> function turning a version-n meta dict into version n+1 (none yet)."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


# ---------------------------------------------------------------------------------------------
# When and where: the plan a run hands to the gradient sink and the store actor.

@dataclass(frozen=True)
class CheckpointPlan:
    """Where and when one run saves checkpoints (small and picklable: the sink and the store hold one)."""

    directory: str
    """The run's checkpoint directory (``<run dir>/checkpoints``); step-NNNNNN subdirectories go here."""
    every: int
    """Save after every this many steps and at the end of the run; 0: only when interrupted."""
    keep: int
    """How many of the newest checkpoints to keep; older ones are removed after each save."""
    run_config: dict
    """The run's TrainConfig as a dict, stored in every checkpoint so --resume needs nothing else."""
    run_id: str
    """The run's id (its directory name), recorded in each checkpoint's meta.json."""
    data_state: dict = field(default_factory=dict)
    """The data loader's position record (:meth:`BatchSource.state`: fingerprint, seed, shapes), to
    which each checkpoint adds its ``next_step``."""
    wait_s: float = 0.0
    """How long a save waits for every unit to reach the boundary (the driver's save on an interrupt
    waits for the sink to apply the steps still in flight)."""

    def due(self, step: int, start: int, end: int) -> bool:
        """Whether the sink saves the boundary after ``step`` updates (``start`` is already on disk)."""
        return self.every > 0 and step != start and (step % self.every == 0 or step == end)

    def save(self, store, step: int) -> str:
        """Write the boundary ``step`` of a HostStore, then prune to the newest ``keep``; returns the path."""
        path = save(store, self.directory, step, self.run_config, self.run_id, self.data_state,
                    wait_s=self.wait_s)
        prune(self.directory, self.keep)
        return path


# ---------------------------------------------------------------------------------------------
# Writing.

def save(store, root: str, step: int, run_config: dict, run_id: str = "", data_state: dict | None = None,
         shard_bytes: int = SHARD_BYTES, wait_s: float = 0.0) -> str:
    """Write the store (a HostStore at boundary ``step``) to ``root``/step-NNNNNN atomically; returns it.

    Waits up to ``wait_s`` for every unit to reach version ``step``. If the directory already
    exists (the same run saved this boundary already), nothing is written.
    """
    units = store.layout.units
    deadline = time.monotonic() + wait_s
    while (any(store.version(i) < step for i in range(len(units))) and time.monotonic() < deadline
           and not any(store.version(i) > step for i in range(len(units)))):
        time.sleep(0.01)
    stale = {u: store.version(i) for i, u in enumerate(units) if store.version(i) != step}
    if stale:
        raise CheckpointError(f"refusing to checkpoint step {step}: units {_names(list(stale))} are at versions "
                              f"{sorted(set(stale.values()))}, so the store is not at a step boundary.")
    final = os.path.join(root, step_dir_name(step))
    if os.path.isdir(final):
        return final
    tmp = os.path.join(root, f".{step_dir_name(step)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(tmp)
        spec, layout = store.spec, store.layout
        model_tensors = [(hf_name(u, name), (lambda i=i, n=name: store.params("master", i)[n]))
                         for i, u in enumerate(units) for name, _, _ in layout.templates[i].params]
        optim_tensors = [(f"{kind}.{hf_name(u, name)}", (lambda i=i, n=name, k=kind: store.params(k, i)[n]))
                         for i, u in enumerate(units) for kind in OPTIM_KINDS
                         for name, _, _ in layout.templates[i].params]
        _write_shards(tmp, "model", MODEL_INDEX, model_tensors, shard_bytes)
        _write_shards(tmp, "optimizer", OPTIM_INDEX, optim_tensors, shard_bytes)
        hf = spec.model.to_hf_dict()
        hf["torch_dtype"] = str(spec.precision.master).removeprefix("torch.")
        _write_json(os.path.join(tmp, "config.json"), hf)
        data = run_config.get("data", {})
        train = run_config.get("train", {})
        tokens_per_step = train.get("micro_batch_size", 0) * train.get("num_micro_batches", 0) * train.get(
            "seq_len", 0)
        _write_json(os.path.join(tmp, META_FILE), {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": step,
            "versions": {u: store.version(i) for i, u in enumerate(units)},
            "adamw_step": step,
            "data": {**(data_state or {}), "next_step": step, "path": data.get("path"),
                     "sequences_consumed": step * train.get("micro_batch_size", 0) * train.get("num_micro_batches", 0),
                     "tokens_consumed": step * tokens_per_step},
            "rng": {"seed": train.get("seed"),
                    "data_sampler": "numpy.random.default_rng([train.seed, step]) draws the batch of each step",
                    "draws_after_init": 0},
            "precision": {"master": str(spec.precision.master).removeprefix("torch."), "optim_state": "float32"},
            "model": spec.model.to_hf_dict(),
            "config": run_config,
            "run_id": run_id,
            "saved_at": time.time(),
        })
        _fsync_dir(tmp)
        try:
            os.rename(tmp, final)
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST) and os.path.isdir(final):
                shutil.rmtree(tmp, ignore_errors=True)  # saved concurrently at the same boundary
                return final
            raise
        _fsync_dir(root)
        return final
    except CheckpointError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        last = latest(root, missing_ok=True)
        kept = f"the last good checkpoint, {last}, is intact" if last else "no earlier checkpoint exists"
        raise CheckpointError(f"could not write the checkpoint of step {step} to {root} "
                              f"({e.strerror or e}); free space there or set runtime.run_dir to a larger disk; "
                              f"{kept}.") from None


def _write_shards(directory: str, prefix: str, index_name: str,
                  tensors: list[tuple[str, Callable[[], torch.Tensor]]], shard_bytes: int) -> None:
    """tensors: (name, view getter) in order -> ``prefix``-0000k-of-0000n.safetensors + index."""
    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, get in tensors:
        t = get()
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, t))
        size += nbytes
    weight_map, total = {}, 0
    for g, group in enumerate(groups):
        filename = f"{prefix}-{g + 1:05d}-of-{len(groups):05d}.safetensors"
        total += write_safetensors(os.path.join(directory, filename), group)
        weight_map.update({name: filename for name, _ in group})
    _write_json(os.path.join(directory, index_name), {"metadata": {"total_size": total}, "weight_map": weight_map})


def write_safetensors(path: str, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Write tensors to one safetensors file straight from their memory (no copy); fsynced; returns bytes.

    The format: an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
    offsets), padded to 8 bytes, then the raw bytes in order.
    """
    tensors = list(tensors)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors:
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"cannot checkpoint tensor {name} of dtype {t.dtype}.")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, t in tensors:
            f.write(t.contiguous().view(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())
    return offset


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune(root: str, keep: int) -> list[str]:
    """Remove all but the newest ``keep`` checkpoints, and temporary directories of dead savers."""
    import psutil

    removed = []
    for step, path in _complete(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = re.match(r"^\.step-\d+\.tmp-(\d+)-", name)
        if m and not psutil.pid_exists(int(m.group(1))):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(os.path.join(root, name))
    return removed


# ---------------------------------------------------------------------------------------------
# Finding and reading.

def _complete(root: str) -> list[tuple[int, str]]:
    """(step, path) of the complete checkpoints in ``root``, oldest first."""
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(root, name, META_FILE)):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)


def latest(root: str, missing_ok: bool = False) -> str | None:
    """The newest complete checkpoint in a checkpoint directory (None if there is none and missing_ok)."""
    found = _complete(root)
    if found:
        return found[-1][1]
    if missing_ok:
        return None
    raise CheckpointError(f"{root} holds no complete checkpoint (no step-NNNNNN directory with a {META_FILE}).")


def find(path: str) -> str:
    """A checkpoint directory from what the user passed to --resume: a checkpoint or a run directory."""
    if not os.path.isdir(path):
        raise CheckpointError(f"--resume {path!r} is not a directory; pass a run directory (runs/<run id>) "
                              "or one of its checkpoints/step-NNNNNN directories.")
    if os.path.isfile(os.path.join(path, META_FILE)):
        return path
    for root in (os.path.join(path, "checkpoints"), path):
        found = latest(root, missing_ok=True)
        if found:
            return found
    raise CheckpointError(f"--resume {path!r} holds no checkpoint: neither a {META_FILE} nor a "
                          "checkpoints/step-NNNNNN directory with one; was the run stopped before its first save?")


def read_meta(directory: str) -> dict:
    """The meta.json of a checkpoint, upgraded to the current format version."""
    path = os.path.join(directory, META_FILE)
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {directory} has no readable {META_FILE} ({e}).") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{directory} is not a megatrain-ray checkpoint ({META_FILE} lacks "
                              f"format: {FORMAT}).")
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {directory} has format version {version!r}, newer than this "
                              f"megatrain-ray reads ({FORMAT_VERSION}); upgrade megatrain-ray.")
    while version < FORMAT_VERSION:
        meta = _UPGRADES[version](meta)
        version = meta["format_version"]
    return meta


def _index(directory: str, name: str) -> dict[str, str]:
    path = os.path.join(directory, name)
    try:
        with open(path) as f:
            mapping = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {directory} has no readable {name} ({e}).") from None
    return mapping


def check_files(directory: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (file, shape)} of a checkpoint, after opening every shard (catches truncation)."""
    from safetensors import safe_open

    out = {}
    for index in (MODEL_INDEX, OPTIM_INDEX):
        mapping = _index(directory, index)
        for filename in sorted(set(mapping.values())):
            path = os.path.join(directory, filename)
            try:
                with safe_open(path, framework="pt") as f:
                    present = set(f.keys())
                    for key in (k for k, v in mapping.items() if v == filename):
                        if key not in present:
                            raise CheckpointError(f"checkpoint file {path} lacks tensor {key} that its index names.")
                        out[key] = (filename, tuple(f.get_slice(key).get_shape()))
            except CheckpointError:
                raise
            except Exception as e:  # safetensors raises its own error type for a bad file
                raise CheckpointError(f"checkpoint file {path} is missing or corrupt ({e}); resume from an "
                                      "earlier checkpoint of the run.") from None
    return out


def load_into(store, directory: str) -> int:
    """Copy a checkpoint's master weights, AdamW states and versions into a HostStore; returns its step.

    Every file and shape is checked before the first byte is copied; tensors are read one at a
    time through safetensors' memory mapping.
    """
    from safetensors import safe_open

    meta = read_meta(directory)
    check_model(meta, store.spec.model, directory)
    files = check_files(directory)
    layout = store.layout
    wanted = []
    for i, unit in enumerate(layout.units):
        for name, shape, _ in layout.templates[i].params:
            name_of = {"master": hf_name(unit, name), **{k: f"{k}.{hf_name(unit, name)}" for k in OPTIM_KINDS}}
            for kind, key in name_of.items():
                if key not in files:
                    raise CheckpointError(f"checkpoint {directory} lacks tensor {key}.")
                if files[key][1] != tuple(shape):
                    raise CheckpointError(f"tensor {key} in checkpoint {directory} has shape {files[key][1]}, "
                                          f"but the model needs {tuple(shape)}.")
                wanted.append((kind, i, name, key))
    versions = meta.get("versions", {})
    if sorted(versions) != sorted(layout.units) or set(versions.values()) != {meta["step"]}:
        raise CheckpointError(f"checkpoint {directory} has unit versions {versions} that are not all its step "
                              f"{meta['step']}; it was not taken at a step boundary.")
    for kind, i, name, key in sorted(wanted, key=lambda w: (files[w[3]][0], w[3])):
        with safe_open(os.path.join(directory, files[key][0]), framework="pt") as f:
            store.params(kind, i)[name].copy_(f.get_tensor(key))
    for i, unit in enumerate(layout.units):
        store.set_version(i, versions[unit])
        store.refresh_stream(i)
    return meta["step"]


def check_model(meta: dict, model, directory: str) -> None:
    """A ConfigError naming the differing fields if the checkpoint holds another model than ``model``."""
    saved, ours = meta.get("model", {}), model.to_hf_dict()
    diffs = [f"{k} {saved[k]!r} vs {ours[k]!r}" for k in sorted(ours) if k in saved and saved[k] != ours[k]]
    if diffs:
        raise ConfigError(f"checkpoint {directory} holds a different model than the run's config "
                          f"({'; '.join(diffs[:4])}{' ...' if len(diffs) > 4 else ''}); resume without "
                          "changing model.* or runtime.init_from, or start a new run from its weights "
                          f"with runtime.init_from={directory}.")


def _names(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


# ---------------------------------------------------------------------------------------------
# --resume: the run config of a checkpoint, with the user's overrides.

def resume_config(path: str, config_file: str | None, overrides: list[str]):
    """(TrainConfig, checkpoint dir, meta) for ``train --resume PATH [--config F] [--set k=v ...]``.

    The checkpoint's own run config is the base; a config file and ``--set`` overrides apply on
    top (e.g. more ``train.steps``, see :func:`check_resume`; another ``runtime.run_dir``). The
    weights come from the checkpoint; ``runtime.init_from`` is kept for what else it provides (the
    model's config, the tokenizer), and ``--set runtime.init_from=null`` drops it. A different
    model shape is an error.
    """
    from .hf_io import load_train_config

    directory = os.path.abspath(find(path))
    meta = read_meta(directory)
    base = json.loads(json.dumps(meta.get("config") or {}))
    if not isinstance(base.get("runtime"), dict) or not isinstance(base.get("model"), dict):
        raise CheckpointError(f"checkpoint {directory} has no run config in its {META_FILE}.")
    cfg = load_train_config(config_file, overrides, base=base)
    check_model(meta, cfg.model, directory)
    return cfg, directory, meta


def check_resume(meta: dict, cfg, directory: str) -> str | None:
    """Refuse (ConfigError) a resume with nothing left to train; describe a changed lr schedule.

    The gradient sink computes each step's learning rate from the resumed run's optim section and
    train.steps, so a train.steps other than the checkpoint's run had (or other optim.* settings)
    recomputes the warmup + cosine schedule: the run goes on at the new schedule's rate for its next
    step, not the old one's. Extending a finished run is done that way, explicitly, and the returned
    sentence (None when the schedule is unchanged) says what it does to the learning rate.
    """
    from ..config import OptimConfig, lr_at

    step, steps = meta["step"], cfg.train.steps
    saved = meta.get("config") or {}
    old_steps = (saved.get("train") or {}).get("steps", steps)
    if step >= steps:
        if old_steps == step == steps:
            raise ConfigError(f"checkpoint {directory} is the end of its run (step {step} of train.steps {steps}), "
                              f"so there is nothing to resume; to train on, extend the run explicitly with "
                              f"--set train.steps=N (N > {step}), which recomputes the cosine schedule over N steps.")
        raise ConfigError(f"train.steps ({steps}) is not beyond the checkpoint's step ({step}), so there is nothing "
                          f"to resume; raise it with --set train.steps=N (N > {step}).")
    try:
        old_optim = OptimConfig(**saved["optim"])
    except (KeyError, TypeError):
        old_optim = cfg.optim
    new_lr, old_lr = lr_at(cfg.optim, step, steps), lr_at(old_optim, step, old_steps)
    if old_steps == steps and new_lr == old_lr:
        return None
    last = f" (step {step}, the last one trained, ran at {lr_at(old_optim, step - 1, old_steps):.2e})" if step else ""
    if old_steps != steps:
        verb = "extending" if steps > old_steps else "shortening"
        return (f"{verb} the run from {old_steps} to {steps} steps: the cosine schedule is recomputed over {steps} "
                f"steps, so step {step + 1} runs at lr {new_lr:.2e}{last}")
    return (f"the learning-rate schedule differs from the checkpoint's run (optim.* changed): step {step + 1} "
            f"runs at lr {new_lr:.2e} instead of {old_lr:.2e}{last}")
