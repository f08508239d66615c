"""Keys of the former ``runtime`` section: where each went, the one sentence a config that still uses
one gets, and the upgrade of a run config saved with them (a checkpoint's meta.json, a run's
config.json) to the sections of today.

A user's YAML file or ``--set runtime.X=...`` is refused at load with the sentence naming the new
place (nothing is silently read another way); a saved run config is the program's own record, so it
is upgraded, its values carried to their new keys.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError

MOVED = {
    "compute_dtype": "precision.compute_dtype", "master_dtype": "precision.master_dtype",
    "grad_dtype": "precision.grad_dtype",
    "device": "compute.device", "compile": "compute.compile", "compile_threads": "compute.compile_threads",
    "attention_backend": "compute.attention_backend",
    "buffer_depth": "memory.buffer_depth", "loss_chunk_size": "memory.loss_chunk_size",
    "mlp_chunk_size": "memory.mlp_chunk_size", "shm_dir": "memory.shm_dir",
    "compute_workers": "parallel.compute_workers", "nodes": "parallel.nodes",
    "optimizer_sharding": "parallel.optimizer_sharding", "optimizer_threads": "parallel.optimizer_threads",
    "ray_address": "cluster.ray_address", "object_store_memory": "cluster.object_store_memory",
    "dashboard": "cluster.dashboard", "actor_timeout_s": "cluster.actor_timeout_s",
    "max_restarts": "cluster.max_restarts", "health_timeout_s": "cluster.health_timeout_s",
    "hold_grads": "experimental.hold_grads", "grad_reduce": "experimental.grad_reduce",
    "cpu_affinity": "experimental.cpu_affinity",
    "init_from": "train.init_from", "run_dir": "train.run_dir", "loggers": "train.loggers",
}
"""Former runtime.X -> its key now, for the keys that moved unchanged."""

REWRITTEN = {
    "activations": "runtime.activations is now memory.activations (auto, recompute, offload, keep, or counts "
                   "with the counts of \"keep=K,host=H,span=P\" as memory.kept_layers, memory.offloaded_layers "
                   "and memory.spanned_layers)",
    "device_adamw": "runtime.device_adamw is now memory.resident (auto, none, or embed_head for the former "
                    "edges; edges+K is embed_head with memory.resident_layers: K)",
    "offload_activations": "runtime.offload_activations is gone: write memory.activations: offload, which says "
                           "the same",
    "split_update": "runtime.split_update is gone: the two-pass update is bit for bit the one-pass update, so "
                    "every run it applies to uses it",
}
"""Former runtime.X whose form changed or that is gone -> the sentence that says so."""

SECTIONS_NOW = "precision, compute, memory, parallel, cluster, experimental and train"


def refuse_runtime(section: Any) -> None:
    """Raise the one sentence for a ``runtime`` section of a user's config (each key names its new
    place; see the module docstring)."""
    keys = list(section) if isinstance(section, dict) else []
    for key in keys:
        if key in MOVED:
            raise ConfigError(f"runtime.{key} is now {MOVED[key]}; write it there "
                              f"(under {MOVED[key].split('.')[0]}: in the file, or --set {MOVED[key]}=...).")
        if key in REWRITTEN:
            raise ConfigError(f"{REWRITTEN[key]}.")
    known = f"; runtime's keys moved to the sections {SECTIONS_NOW} (see docs/configuration.md)."
    raise ConfigError((f"runtime.{keys[0]} is not a known key" if keys else "runtime is no longer a section")
                      + known)


def _activations(value: str) -> dict[str, Any]:
    """The former runtime.activations (a mode or ``"keep=K,host=H,span=P"``) as memory's keys."""
    if value in ("auto", "recompute", "offload", "keep"):
        return {"activations": value}
    counts = {"keep": 0, "host": 0, "span": 0}
    for part in str(value).replace(" ", "").split(","):
        key, _, number = part.partition("=")
        if key not in counts or not number.isdigit():
            raise ConfigError(f"the saved runtime.activations {value!r} is not a mode or counts; "
                              "set memory.activations with --set.")
        counts[key] = int(number)
    return {"activations": "counts", "kept_layers": counts["keep"], "offloaded_layers": counts["host"],
            "spanned_layers": counts["span"]}


def _resident(value: str) -> dict[str, Any]:
    """The former runtime.device_adamw (auto, none, edges, edges+K) as memory's keys."""
    if value in ("auto", "none"):
        return {"resident": value}
    head, _, count = str(value).partition("+")
    if head != "edges" or not (count.isdigit() or not count):
        raise ConfigError(f"the saved runtime.device_adamw {value!r} is not auto, none, edges or edges+K; "
                          "set memory.resident with --set.")
    return {"resident": "embed_head", "resident_layers": int(count or 0)}


def upgrade_saved(data: dict[str, Any]) -> dict[str, Any]:
    """A saved run config with a ``runtime`` section, as the sections of today (a copy; one without
    is returned as it is)."""
    if not isinstance(data.get("runtime"), dict):
        return data
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items() if k != "runtime"}
    runtime = dict(data["runtime"])
    offload = runtime.pop("offload_activations", False)
    runtime.pop("split_update", None)
    moved: dict[str, dict[str, Any]] = {}
    if "activations" in runtime or offload:
        setting = runtime.pop("activations", "auto")
        moved.setdefault("memory", {}).update(_activations("offload" if offload else setting))
    if "device_adamw" in runtime:
        moved.setdefault("memory", {}).update(_resident(runtime.pop("device_adamw")))
    for key, value in runtime.items():
        if key not in MOVED:
            raise ConfigError(f"the saved run config has runtime.{key}, which no section has now; "
                              "it was written by a newer or unknown version.")
        section, name = MOVED[key].split(".")
        moved.setdefault(section, {})[name] = value
    for section, values in moved.items():
        out[section] = {**(out.get(section) or {}), **values}
    return out


def saved_run_config(data: Any) -> dict[str, Any] | None:
    """``data`` in today's sections if it is a saved run config (a model section, and a train or the
    former runtime section), else None."""
    if isinstance(data, dict) and "model" in data and ("train" in data or "runtime" in data):
        return upgrade_saved(data)
    return None
