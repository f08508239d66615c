"""Training checkpoints: one flat, layout-independent directory per step boundary, written atomically.

A checkpoint holds everything a run needs to continue bit for bit::

    <run dir>/checkpoints/step-000300/
        config.json                        HF config of the model (the directory loads in transformers)
        model.safetensors.index.json       {"weight_map": {HF tensor name: shard file}}
        model-00001-of-00002.safetensors   master weights, full HF names, master dtype
        optimizer.safetensors.index.json   {"weight_map": {"exp_avg.<HF name>" / "exp_avg_sq.<HF name>": shard}}
        optimizer-00001-of-00003.safetensors   AdamW moments, fp32 (optim.state 8bit: per-unit uint8 codes
                                           and fp32 block scales, see optim_tensors_of)
        meta.json                          step, unit versions, data position, RNG, run config, format version,
                                           and the size and CRC-32 of every other file

Nothing in it depends on how the store lays units out (padding, alignment, unit order): tensors
are found by name, so a checkpoint loads into any later layout of the same model, and the weights
part is itself a Hugging Face checkpoint (usable as ``train.init_from`` or by ``transformers``).

**Consistency.** A checkpoint is taken at a *step boundary*: every unit has received exactly
``step`` updates and none has started its next one. One writer writes them all
(:class:`megatrain_ray.io.writer.CheckpointWriter`): the gradient sink starts the periodic ones at
the top of its step loop (all updates of the previous step are done, none of this step's has
begun) and goes on updating while they are written, each unit only once its bytes are written; on
an interrupt the driver stops submitting steps, lets the pipeline finish those in flight, and has
the store actor save. The writer checks that every unit's version equals ``step`` before writing
anything.

**Atomicity.** Files are written (by :func:`megatrain_ray.io.files.write_file`, each fsynced) into a
hidden ``.step-000300.tmp-<pid>-<random>`` directory next to the final one, ``meta.json`` last;
then the directory is renamed into place (atomic on one filesystem) and the parent fsynced. A crash
or a full disk at any point leaves at most a temporary directory, which readers ignore and the next
save removes; older checkpoints are pruned (keep-last-K) only after a new one is complete.

**Integrity.** Every file's size and CRC-32 (computed while it is written) are in ``meta.json``,
and ``meta.json`` carries the CRC-32 of its own content (:func:`meta_checksum`), checked whenever
it is read: a changed bit in its step or a garbled key makes the checkpoint corrupt like a changed
shard.
:func:`check_files` compares sizes, reads every shard's safetensors header and recomputes the
checksums, before a resume (in the driver, before any actor starts) and an export; a checkpoint
whose bytes changed, even without a change of size, is refused naming the file. ``--resume`` of a
run directory falls back to its newest checkpoint that passes (:mod:`megatrain_ray.io.resume`).

**Upgrades.** ``meta.json`` carries ``format_version``; :data:`_UPGRADES` turns an older meta dict
into the next version's, so old checkpoints keep loading after the format changes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Callable

from ..errors import CheckpointError, ConfigError
from ..model.transformer import hf_name
from .files import CorruptFile, check_sizes, read_header, verify
from .state_tensors import COMPACT_KINDS, OPTIM_KINDS, optim_tensors_of  # noqa: F401  (re-exported)
from .state_tensors import optim_state_name as _optim_state_name

FORMAT = "megatrain-ray-checkpoint"
FORMAT_VERSION = 3
META_FILE = "meta.json"
MODEL_INDEX = "model.safetensors.index.json"
OPTIM_INDEX = "optimizer.safetensors.index.json"
SHARD_BYTES = 2 * 2**30
_STEP_DIR = re.compile(r"^step-(\d+)$")

_UPGRADES: dict[int, Callable[[dict], dict]] = {
    1: lambda meta: {**meta, "format_version": 2, "files": None},  # 2 added "files": {name: {bytes, crc32}}
    2: lambda meta: {**meta, "format_version": 3, "meta_crc32": None},  # 3 added meta.json's own checksum
}
"""format_version n -> function turning a version-n meta dict into version n+1."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


# ---------------------------------------------------------------------------------------------
# When and where: the settings a run hands to the gradient sink and the store actor.

@dataclass(frozen=True)
class CheckpointSettings:
    """Where and when one run saves checkpoints (small and picklable: the sink and the store hold one)."""

    directory: str
    """The run's checkpoint directory (``<run dir>/checkpoints``); step-NNNNNN subdirectories go here."""
    every: int
    """Save after every this many steps and at the end of the run; 0: only when interrupted (unless
    train.checkpoint_on_interrupt is false), and by the driver at the end before the final export (so
    the trained weights are on disk before it is tried)."""
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
    staging_bytes: int = 0
    """Host memory the sink may fill with copies of units not yet written (train.checkpoint_staging_gib)."""

    def due(self, step: int, start: int, end: int) -> bool:
        """Whether the sink saves the boundary after ``step`` updates (``start`` is already on disk)."""
        return self.every > 0 and step != start and (step % self.every == 0 or step == end)


# ---------------------------------------------------------------------------------------------
# Pruning (after each save of :mod:`megatrain_ray.io.writer`).

def prune(root: str, keep: int) -> list[str]:
    """Remove all but the newest ``keep`` checkpoints, and temporary directories of dead savers."""
    import psutil

    removed = []
    for step, path in _complete(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    for name, pid in _unfinished(root):
        if not psutil.pid_exists(pid):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(os.path.join(root, name))
    return removed


def remove_unfinished(root: str, within: float = 10.0) -> list[str]:
    """Remove the temporary directories of saves cut short in ``root`` (a sink's periodic save still
    writing when the run was torn down after an interrupt had saved the same boundary), waiting up to
    ``within`` seconds for their writers' processes, killed with the run's roles, to be gone; one whose
    writer still lives then stays (the next save's :func:`prune` removes it), as does one of this
    process (a writer thread of a run without Ray)."""
    import psutil

    writers, gone = {}, set()
    for name, pid in _unfinished(root):
        if pid == os.getpid():
            continue
        try:
            writers[name] = psutil.Process(pid)
        except psutil.NoSuchProcess:
            gone.add(name)
    ended, _ = psutil.wait_procs(list(writers.values()), timeout=within)
    gone |= {name for name, p in writers.items() if p in ended}
    for name in sorted(gone):
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return [os.path.join(root, name) for name in sorted(gone)]


def _unfinished(root: str) -> list[tuple[str, int]]:
    """(name, writer's pid) of the temporary directories of saves in ``root``."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return [(n, int(m.group(1))) for n in names if (m := re.match(r"^\.step-\d+\.tmp-(\d+)-", n))]


# ---------------------------------------------------------------------------------------------
# Finding and reading.

def _complete(root: str) -> list[tuple[int, str]]:
    """(step, path) of the checkpoints in ``root`` that have a meta.json (renamed into place), oldest first."""
    return [(step, path) for step, path in step_dirs(root) if os.path.isfile(os.path.join(path, META_FILE))]


def step_dirs(root: str) -> list[tuple[int, str]]:
    """(step, path) of every step-NNNNNN directory in ``root``, oldest first."""
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)


def stray_steps(root: str) -> list[str]:
    """Entries of ``root`` named like a checkpoint (step-NNNNNN) that are not directories."""
    return sorted(os.path.join(root, n) for n in (os.listdir(root) if os.path.isdir(root) else [])
                  if _STEP_DIR.match(n) and not os.path.isdir(os.path.join(root, n)))


def latest(root: str, missing_ok: bool = False) -> str | None:
    """The newest valid checkpoint in a checkpoint directory (readable meta.json, every file of the size
    it was written with and a sound safetensors header; checksums are not recomputed), or None if there
    is none and ``missing_ok``."""
    for _, path in reversed(_complete(root)):
        if problem(path, checksums=False) is None:
            return path
    if missing_ok:
        return None
    raise CheckpointError(f"{root} holds no valid checkpoint (a step-NNNNNN directory with a readable {META_FILE}).")


def advice(directory: str) -> str:
    """What to run to go on from a checkpoint: resume it, or at the end of its run, export it or extend the run."""
    try:
        meta = read_meta(directory)
    except CheckpointError:
        return f"resume with `megatrain-ray train --resume {directory}`"
    step, steps = meta.get("step"), ((meta.get("config") or {}).get("train") or {}).get("steps")
    if isinstance(step, int) and isinstance(steps, int) and step >= steps:
        return (f"it is the end of the run: export its weights with `megatrain-ray export {directory} --out DIR`, "
                f"or train on with `megatrain-ray train --resume {directory} --set train.steps=N` (N > {step})")
    return f"resume with `megatrain-ray train --resume {directory}`"


def _read_meta(directory: str) -> dict:
    """The meta.json of a checkpoint, upgraded; a CorruptFile gives the reason it cannot be read."""
    path = os.path.join(directory, META_FILE)
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CorruptFile(f"it has no {META_FILE}") from None
    except (OSError, ValueError) as e:
        raise CorruptFile(f"its {META_FILE} is not readable JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CorruptFile(f"it is not a megatrain-ray checkpoint ({META_FILE} lacks format: {FORMAT})")
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CorruptFile(f"it has format version {version!r}, newer than this megatrain-ray reads "
                          f"({FORMAT_VERSION}); upgrade megatrain-ray")
    if (version >= 3 or "meta_crc32" in meta) and meta.get("meta_crc32") != meta_checksum(meta):
        raise CorruptFile(f"its {META_FILE} does not match its checksum (its content changed after it was written)")
    while version < FORMAT_VERSION:
        meta = _UPGRADES[version](meta)
        version = meta["format_version"]
    return meta


def meta_checksum(meta: dict) -> str:
    """The CRC-32 (8 hex digits) of a meta dict's content, its ``meta_crc32`` left out: of its JSON
    with sorted keys and no spaces, which parsing and writing again reproduces exactly."""
    import zlib

    body = json.dumps({k: v for k, v in meta.items() if k != "meta_crc32"}, sort_keys=True,
                      separators=(",", ":")).encode()
    return f"{zlib.crc32(body):08x}"


def read_meta(directory: str) -> dict:
    """The meta.json of a checkpoint, upgraded to the current format version."""
    try:
        return _read_meta(directory)
    except CorruptFile as e:
        raise CheckpointError(f"checkpoint {directory} cannot be read: {e}.") from None


def _index(directory: str, name: str) -> dict[str, str]:
    path = os.path.join(directory, name)
    try:
        with open(path) as f:
            mapping = json.load(f)["weight_map"]
        if not isinstance(mapping, dict):
            raise TypeError("weight_map is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptFile(f"its {name} is not readable ({e})") from None
    return mapping


_VERIFIED: set[tuple] = set()
"""(directory, ((file, mtime) ...)) of checkpoints whose checksums this process has verified."""


def _check(directory: str, checksums: bool) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (file, shape)} after the checks of :func:`check_files`; a CorruptFile says what failed."""
    meta = _read_meta(directory)
    records = meta.get("files")  # None: written before format 2, which has no sizes and checksums
    if records:
        check_sizes(directory, records)
    out = {}
    for index in (MODEL_INDEX, OPTIM_INDEX):
        mapping = _index(directory, index)
        for filename in sorted(set(mapping.values())):
            try:
                header = read_header(os.path.join(directory, filename))
            except CorruptFile as e:
                raise CorruptFile(f"{filename} is not a sound safetensors file ({e})") from None
            for key in (k for k, v in mapping.items() if v == filename):
                if key not in header:
                    raise CorruptFile(f"{filename} lacks the tensor {key} that its index names")
                out[key] = (filename, header[key][1])
    if checksums and records:
        stats = tuple((n, os.stat(os.path.join(directory, n)).st_mtime_ns) for n in sorted(records))
        if (os.path.abspath(directory), stats) not in _VERIFIED:
            verify(directory, records)
            _VERIFIED.add((os.path.abspath(directory), stats))
    return out


def problem(directory: str, checksums: bool = True) -> str | None:
    """Why a checkpoint cannot be used (a phrase), or None if it passes :func:`check_files`."""
    try:
        _check(directory, checksums)
    except CorruptFile as e:
        return str(e)
    return None


def check_files(directory: str, checksums: bool = True) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (file, shape)} of a checkpoint, after checking its files: meta.json readable, every
    file of the size it was written with, every shard's safetensors header sound and naming the tensors
    the index puts there, and (``checksums``) every file's CRC-32 the one written with it (recomputed
    once per process and file version: see :mod:`megatrain_ray.io.files` for the cost). One sentence
    naming the file is raised otherwise."""
    try:
        return _check(directory, checksums)
    except CorruptFile as e:
        raise CheckpointError(f"checkpoint {directory} is corrupt: {e}; use an earlier checkpoint of the run.") from None


def load_into(store, directory: str) -> int:
    """Copy a checkpoint's master weights, AdamW states and versions into a HostStore; returns its step.

    Every file and shape is checked before the first byte is copied; tensors are read one at a
    time through safetensors' memory mapping.
    """
    from safetensors import safe_open

    meta = read_meta(directory)
    check_model(meta, store.spec.model, directory)
    files = check_files(directory, checksums=False)  # the driver verified them (pipeline.train)
    layout = store.layout
    saved_state = meta.get("precision", {}).get("optim_state", "float32")
    if saved_state != _optim_state_name(store):
        raise ConfigError(f"checkpoint {directory} holds the {saved_state} optimizer state but the run has optim.state="
                          f"{'8bit' if store.spec.precision.compact else 'fp32'}; resume with optim.state="
                          f"{'8bit' if saved_state == '8bit' else 'fp32'}, or start a new run from its weights "
                          f"with train.init_from={directory}.")
    wanted = []
    targets = [(hf_name(unit, name), store.params("master", i)[name])
               for i, unit in enumerate(layout.units) for name, _, _ in layout.templates[i].params]
    for key, target in targets + optim_tensors_of(store):
        if key not in files:
            raise CheckpointError(f"checkpoint {directory} lacks tensor {key}.")
        if files[key][1] != tuple(target.shape):
            raise CheckpointError(f"tensor {key} in checkpoint {directory} has shape {files[key][1]}, "
                                  f"but the model needs {tuple(target.shape)}.")
        wanted.append((key, target))
    versions = meta.get("versions", {})
    if sorted(versions) != sorted(layout.units) or set(versions.values()) != {meta["step"]}:
        raise CheckpointError(f"checkpoint {directory} has unit versions {versions} that are not all its step "
                              f"{meta['step']}; it was not taken at a step boundary.")
    for key, target in sorted(wanted, key=lambda w: (files[w[0]][0], w[0])):
        with safe_open(os.path.join(directory, files[key][0]), framework="pt") as f:
            target.copy_(f.get_tensor(key))
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
                          "changing model.* or train.init_from, or start a new run from its weights "
                          f"with train.init_from={directory}.")


# ---------------------------------------------------------------------------------------------
# --resume: what is left to train.

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
