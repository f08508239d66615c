"""``train --resume PATH``: which checkpoint PATH means, and the run config to continue it with.

PATH is a checkpoint (``runs/<id>/checkpoints/step-NNNNNN``), used as it is: if it fails its checks
the run is refused, naming the file. Or it is a run directory (or its ``checkpoints/``): its newest
checkpoint that passes every check, checksums included, is used, and each newer one that fails (a
shard cut short, a meta.json empty or garbled, a changed byte) is named in a line with the reason
it was skipped; if none passes, the error names them all.

A resumed run continues its own run directory, as one run with one history
(:func:`continued_run`): its metrics.jsonl and train.log are appended to, its checkpoints and final
weights written in place. It writes a run directory of its own (whose config.json names the
checkpoint, ``resumed_from``) only when continuing in place would change what is there: the
checkpoint is not the run's newest (the newer ones stay as they are), or ``train.run_dir`` was set
to another folder.
"""

from __future__ import annotations

import dataclasses
import json
import os

from .checkpoint import META_FILE, CheckpointError, check_model, problem, read_meta, step_dirs, stray_steps
from . import run_lock
from ..config.moved import upgrade_saved
from .hf_io import load_train_config


def find(path: str, log=print) -> str:
    """The checkpoint directory ``--resume PATH`` means (see the module docstring)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"--resume {path!r} is not a directory; pass a run directory (runs/<run id>) "
                              "or one of its checkpoints/step-NNNNNN directories.")
    if os.path.isfile(os.path.join(path, META_FILE)):
        return path
    root = os.path.join(path, "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else path
    found = step_dirs(root)
    skipped = []
    for stray in stray_steps(root):
        log(f"resume: passed over {stray}, which is a file, not a checkpoint directory")
    for _, directory in reversed(found):
        why = problem(directory)
        if why is None:
            for bad, reason in skipped:
                log(f"resume: skipped the corrupt checkpoint {bad} ({reason}); using {directory}, the newest valid one")
            return directory
        skipped.append((directory, why))
    runs = sorted(n for n in os.listdir(path) if step_dirs(os.path.join(path, n, "checkpoints")))
    if not found and runs:
        raise CheckpointError(f"--resume {path!r} is a folder of runs, not one run; pass one of them, e.g. the newest: "
                              f"--resume {os.path.join(path, runs[-1])}.")
    if skipped:
        raise CheckpointError(f"--resume {path!r} holds no valid checkpoint: "
                              + "; ".join(f"{d} is corrupt ({why})" for d, why in skipped) + ".")
    raise CheckpointError(f"--resume {path!r} holds no checkpoint: neither a {META_FILE} nor a "
                          "checkpoints/step-NNNNNN directory with one; was the run stopped before its first save?")


def resume_config(path: str, config_file: str | None, overrides: list[str], log=print):
    """(TrainConfig, checkpoint dir, meta) for ``train --resume PATH [--config F] [--set k=v ...]``.

    The checkpoint's own run config is the base; a config file and ``--set`` overrides apply on
    top (e.g. more ``train.steps``, see :func:`megatrain_ray.io.checkpoint.check_resume`; another
    ``train.run_dir``). The weights come from the checkpoint; ``train.init_from`` is kept for what
    else it provides (the model's config, the tokenizer), and ``--set train.init_from=null`` drops it.
    A different model shape is an error. Unless ``train.run_dir`` is set anew, it is the folder
    that holds the checkpoint's run, so the run continues where it is (:func:`continued_run`) from
    whatever directory the command runs in.
    """
    run_lock.check(run_lock.run_of(path), "resuming")
    directory = os.path.abspath(find(path, log))
    meta = read_meta(directory)
    base = json.loads(json.dumps(meta.get("config") or {}))
    if not isinstance(base.get("train") or base.get("runtime"), dict) or not isinstance(base.get("model"), dict):
        raise CheckpointError(f"checkpoint {directory} has no run config in its {META_FILE}.")
    base = upgrade_saved(base)  # one saved with the former runtime section, in today's sections
    if (base.get("train") or {}).get("init_from"):
        # The model is train.init_from's config.json, so the saved model.* are not the user's settings to
        # check against it: another init_from is told apart from the checkpoint by check_model, below.
        cfg = load_train_config(config_file, overrides, base={k: v for k, v in base.items() if k != "model"})
        if cfg.train.init_from is None:  # --set train.init_from=null: the model as it was saved
            cfg = load_train_config(config_file, overrides, base=base)
    else:
        cfg = load_train_config(config_file, overrides, base=base)
    check_model(meta, cfg.model, directory)
    run = run_lock.run_of(directory)
    if cfg.train.run_dir == (base.get("train") or {}).get("run_dir") and run != directory:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=os.path.dirname(run)))
    return cfg, directory, meta


def continued_run(directory: str, runs_dir: str) -> tuple[str | None, str]:
    """(the run directory a run resumed from checkpoint ``directory`` continues in place, "") or
    (None, why it writes a run directory of its own in ``runs_dir``; "" for a checkpoint outside any
    run). In place only when ``runs_dir`` is the folder that holds the checkpoint's run and no
    checkpoint of that run is newer: those would be overwritten as the run reaches their steps again."""
    run = run_lock.run_of(directory)
    if run == os.path.abspath(directory) or not os.path.isfile(os.path.join(run, "config.json")):
        return None, ""
    if os.path.abspath(runs_dir) != os.path.dirname(run):
        return None, f"train.run_dir ({runs_dir}) is not the folder that holds {run}"
    step = read_meta(directory)["step"]
    later = [p for s, p in step_dirs(os.path.join(run, "checkpoints")) if s > step]
    if later:  # valid ones (an older checkpoint was asked for) or ones that failed their checks
        names = ", ".join(os.path.basename(p) for p in later)
        return None, (f"{run} has checkpoints after it ({names}), which stay as they are (resuming the run "
                      "directory continues it in place when its newest checkpoint is valid)")
    return run, ""
