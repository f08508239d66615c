"""Hugging Face checkpoints in and out: import into the host store, export from it or from a run.

The on-disk format is the one ``transformers`` writes and reads: ``config.json``, sharded
``model-0000k-of-0000n.safetensors`` files with a ``model.safetensors.index.json`` (or a single
``model.safetensors``), and the tokenizer files next to them. A written directory carries the
tokenizer the run used (a copy of its directory, or the byte-level one written as a Hugging Face
tokenizer) and config.json names its end-of-text and beginning-of-text ids (``eos_token_id``,
``bos_token_id``: the source model's where it had them, else the tokenizer's), so ``generate``
stops at EOS. Files get the mode a plain ``open`` would give them (0o666 less the umask).

Memory policy, for every direction: tensors move one at a time. Import reads the shards in order
through safetensors' memory mapping and copies each tensor straight into its place in the store's
master block, under a mapping of its own (see :func:`load_into`); no torch model and no second
full copy of the weights is ever built, and the peak above the store is one tensor (measured by
the tests). Export materialises at most one shard of tensors (``shard_bytes``) before writing it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..config import ARCHITECTURES, SUPPORTED_MODEL_TYPES, ModelConfig, TrainConfig, load_config
from ..data.tokenizer import BYTE_LEVEL, TOKENIZER_FILES, is_tokenizer_dir, load_tokenizer, save_byte_tokenizer
from ..errors import ConfigError, DataError
from ..model.transformer import hf_name

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
EXTRA_FILES = ("generation_config.json",)
"""Other small files of a model directory that an export carries over."""
DEFAULT_SHARD_BYTES = 2 * 2**30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------------
# Reading a model directory.

def read_config(directory: str, what: str = "the checkpoint") -> tuple[ModelConfig, dict]:
    """(ModelConfig, raw config.json dict) of an HF model directory; unsupported ones are ConfigErrors."""
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{what}'s config.json ({path}) is not readable JSON ({e}).") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{what}'s config.json ({path}) must hold a JSON object.")
    archs = [a for a in raw.get("architectures") or [] if a not in ARCHITECTURES.values()]
    if archs:
        raise ConfigError(f"{what} ({directory}) is a {', '.join(archs)}, which is not supported; "
                          f"supported: {', '.join(ARCHITECTURES.values())}.")
    return ModelConfig.from_hf_dict(raw), raw


def load_train_config(path: str | None = None, overrides: list[str] = (), base: dict | None = None) -> TrainConfig:
    """:func:`megatrain_ray.config.load_config`, with ``runtime.init_from``'s config.json as the model
    shape (model.* settings are replaced by it)."""
    return load_config(path, overrides, base, model_from=lambda d: read_config(d, "runtime.init_from")[0])


def weight_map(directory: str, what: str = "the checkpoint") -> dict[str, str]:
    """{tensor name: shard file name} of an HF model directory (sharded with an index, or single-file)."""
    from safetensors import safe_open

    index = os.path.join(directory, INDEX_FILE)
    single = os.path.join(directory, SINGLE_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                mapping = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{what}'s {INDEX_FILE} ({index}) has no readable weight_map ({e}).") from None
        absent = sorted({name for name in mapping.values() if not os.path.isfile(os.path.join(directory, name))})
        if absent:
            raise ConfigError(f"{what} ({directory}) lacks the shard files its index names: {', '.join(absent[:3])}"
                              f"{' ...' if len(absent) > 3 else ''}.")
        return mapping
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as f:
            return {k: SINGLE_FILE for k in f.keys()}
    raise ConfigError(f"{what} ({directory}) holds neither {SINGLE_FILE} nor {INDEX_FILE}; "
                      "PyTorch .bin checkpoints are not supported, re-save it with safe_serialization.")


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    """Tensors an HF checkpoint may carry that the model does not use."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and cfg.tie_word_embeddings)


def expected_names(cfg: ModelConfig) -> dict[str, tuple[str, str]]:
    """{full HF name: (unit, name relative to the unit)} of every parameter the model has."""
    from ..model.transformer import unit_names, unit_params

    return {hf_name(unit, name): (unit, name) for unit in unit_names(cfg) for name, _ in unit_params(cfg, unit)}


def check_tensors(cfg: ModelConfig, mapping: dict[str, str], directory: str, what: str) -> None:
    """Missing or unexpected tensors are one ConfigError naming them."""
    wanted = expected_names(cfg)
    missing = sorted(k for k in wanted if k not in mapping)
    if missing:
        raise ConfigError(f"{what} ({directory}) lacks {len(missing)} tensor(s) a {cfg.model_type} model of this "
                          f"config.json needs: {_names(missing)}.")
    extra = sorted(k for k in mapping if k not in wanted and not _ignorable(k, cfg))
    if extra:
        raise ConfigError(f"{what} ({directory}) holds {len(extra)} tensor(s) a {cfg.model_type} model does not "
                          f"have ({_names(extra)}), so its architecture is not a supported variant of "
                          f"{', '.join(SUPPORTED_MODEL_TYPES)}.")


def _names(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def load_into(store, directory: str, what: str = "runtime.init_from") -> None:
    """Copy an HF checkpoint into ``store``'s master blocks (a HostStore), then refresh stream copies.

    Shards are read in order through safetensors' memory mapping, and each tensor is copied into
    its view of the store (converting dtype on the way) under a mapping of its own: pages of a
    mapped file count as the process's memory until it is unmapped, so holding a whole shard mapped
    would add up to a shard's size; this way the peak on top of the store is the largest tensor.
    Every shape is checked against the config before the first byte is copied.
    """
    from safetensors import safe_open

    cfg = store.spec.model
    mapping = weight_map(directory, what)
    check_tensors(cfg, mapping, directory, what)
    names = expected_names(cfg)
    shapes = _shapes(directory, {k: mapping[k] for k in names})
    units = store.layout.units
    for key, (unit, name) in names.items():
        want = tuple(store.params("master", units.index(unit))[name].shape)
        if shapes[key] != want:
            raise ConfigError(f"tensor {key} in {what} ({directory}) has shape {shapes[key]}, but its "
                              f"config.json implies {want}.")
    for key, (unit, name) in sorted(names.items(), key=lambda kv: (mapping[kv[0]], kv[0])):
        with safe_open(os.path.join(directory, mapping[key]), framework="pt") as f:
            store.params("master", units.index(unit))[name].copy_(f.get_tensor(key))
    for i in range(len(units)):
        store.refresh_stream(i)


def read_unit(directory: str, mapping: dict[str, str], cfg: ModelConfig, unit: str,
              dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """One unit's parameters (names relative to the unit) read from an HF directory, as ``dtype``."""
    from safetensors import safe_open

    from ..model.transformer import unit_params

    out, by_file = {}, {}
    for name, _ in unit_params(cfg, unit):
        key = hf_name(unit, name)
        by_file.setdefault(mapping[key], []).append((key, name))
    for filename, entries in by_file.items():
        with safe_open(os.path.join(directory, filename), framework="pt") as f:
            for key, name in entries:
                out[name] = f.get_tensor(key).to(dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Writing a model directory.

@dataclass(frozen=True)
class TensorSource:
    """One tensor to write: its HF name, its size, and how to produce it (called once, when written)."""

    name: str
    nbytes: int
    load: Callable[[], torch.Tensor]


def write_shards(directory: str, tensors: Iterable[TensorSource], shard_bytes: int) -> dict[str, str]:
    """Write tensors as model-0000k-of-0000n.safetensors + index; returns the weight map.

    Each shard is written under a temporary name and renamed, the index last, so a reader never
    sees a half-written checkpoint; at most one shard's tensors are in memory at once.
    """
    from safetensors.torch import save_file

    groups: list[list[TensorSource]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    os.makedirs(directory, exist_ok=True)
    mapping, total = {}, 0
    for g, group in enumerate(groups):
        filename = f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {t.name: t.load().contiguous() for t in group}
        tmp = os.path.join(directory, filename + ".tmp")
        save_file(shard, tmp, metadata={"format": "pt"})
        os.chmod(tmp, _new_file_mode())  # safetensors creates it 0o600
        os.replace(tmp, os.path.join(directory, filename))
        mapping.update({name: filename for name in shard})
        total += sum(t.nbytes for t in group)
        del shard
    write_json(os.path.join(directory, INDEX_FILE), {"metadata": {"total_size": total}, "weight_map": mapping})
    return mapping


def _new_file_mode() -> int:
    """The mode ``open`` gives a new file: 0o666 less this process's umask (read without changing it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def token_ids(tokenizer: str | None) -> dict:
    """eos_token_id and bos_token_id (None: it has none) of a tokenizer directory or BYTE_LEVEL, for
    config.json; empty for None (unknown) or a directory that cannot be loaded as a tokenizer."""
    if tokenizer is None:
        return {}
    try:
        tok = load_tokenizer(tokenizer)
    except DataError:
        return {}
    return {"eos_token_id": tok.eos_id, "bos_token_id": tok.bos_id}


def write_tokenizer(tokenizer: str | None, out: str) -> list[str]:
    """Put a run's tokenizer into ``out``: a directory's files copied, BYTE_LEVEL written as a Hugging
    Face tokenizer, nothing for None; returns the file names."""
    if tokenizer == BYTE_LEVEL:
        return save_byte_tokenizer(out)
    return copy_side_files(tokenizer, out, TOKENIZER_FILES)


def hf_config(cfg: ModelConfig, dtype: torch.dtype, base: dict | None = None, tokenizer: str | None = None) -> dict:
    """config.json for ``cfg``: the original config's other fields (token ids, ...) kept, the shape ours;
    token ids the original lacks come from ``tokenizer`` (a directory or BYTE_LEVEL; see :func:`token_ids`)."""
    out = dict(base or {})
    for key, value in token_ids(tokenizer).items():
        if out.get(key) is None:
            out[key] = value
    ours = cfg.to_hf_dict()
    if "rope_parameters" in out:  # transformers 5's form: rope_theta and the scaling inside rope_parameters
        out["rope_parameters"] = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    out.update(ours)  # transformers 4's form (rope_theta, rope_scaling), which 5 reads too
    name = str(dtype).removeprefix("torch.")
    out["dtype"] = out["torch_dtype"] = name
    return out


def copy_side_files(src: str | None, out: str, names: Iterable[str] = TOKENIZER_FILES + EXTRA_FILES) -> list[str]:
    """Copy the tokenizer (and generation config) files that exist in ``src`` to ``out``."""
    copied = []
    if src is None or os.path.abspath(src) == os.path.abspath(out):
        return copied
    for name in names:
        path = os.path.join(src, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(out, name))
            copied.append(name)
    return copied


def save_store(store, directory: str, shard_bytes: int = DEFAULT_SHARD_BYTES, source: str | None = None,
               tokenizer: str | None = None) -> list[str]:
    """Write a HostStore's master weights as an HF checkpoint, with config.json and the tokenizer.

    ``source`` is the HF directory the run started from (runtime.init_from) or None: its config.json's
    other fields and its generation_config.json are kept. ``tokenizer`` is the run's (a directory,
    BYTE_LEVEL, or None: none written).
    """
    cfg, dtype = store.spec.model, store.spec.precision.master

    def view(i: int, name: str) -> Callable[[], torch.Tensor]:
        return lambda: store.params("master", i)[name].clone()

    tensors = [TensorSource(hf_name(unit, name), _numel(shape) * dtype.itemsize, view(i, name))
               for i, unit in enumerate(store.layout.units)
               for name, shape, _ in store.layout.templates[i].params]
    mapping = write_shards(directory, tensors, shard_bytes)
    base = None
    if source is not None and os.path.isfile(os.path.join(source, "config.json")):
        base = read_config(source, "runtime.init_from")[1]
    write_json(os.path.join(directory, "config.json"), hf_config(cfg, dtype, base, tokenizer))
    copy_side_files(source, directory, EXTRA_FILES)
    write_tokenizer(tokenizer, directory)
    return sorted(set(mapping.values()))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Export of a finished run or a checkpoint directory.

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
        named = run and run_tokenizer(run.get("data") or {}, (run.get("runtime") or {}).get("init_from"))
        if named == BYTE_LEVEL or is_tokenizer_dir(named):
            return named
        return self.weights_dir if is_tokenizer_dir(self.weights_dir) else None


def resolve_checkpoint(path: str) -> Checkpoint:
    """A run directory (runs/<id>: its final/, else its newest checkpoints/step-*) or a directory of
    HF-format weights (a final/, a training checkpoint, any HF model directory)."""
    if not os.path.isdir(path):
        raise ConfigError(f"{path!r} is not a directory; pass a run directory (runs/<run id>) or a "
                          "checkpoint directory holding config.json and *.safetensors.")
    if not _is_weights_dir(path):
        steps = os.path.join(path, "checkpoints")
        candidates = [os.path.join(path, "final")] + sorted(
            (os.path.join(steps, n) for n in (os.listdir(steps) if os.path.isdir(steps) else [])
             if n.startswith("step-") and _is_weights_dir(os.path.join(steps, n))), reverse=True)
        found = next((c for c in candidates if _is_weights_dir(c)), None)
        if found is None:
            raise ConfigError(f"{path!r} is neither a run directory (with final/ or checkpoints/step-*) nor a "
                              "checkpoint directory (config.json and model*.safetensors); did the run save any?")
        path = found
    weights = os.path.abspath(path)
    up = os.path.dirname(weights)
    run = (_run_config(os.path.join(weights, "meta.json"), key="config")
           or _run_config(os.path.join(up, "config.json"))
           or _run_config(os.path.join(os.path.dirname(up), "config.json")))
    return Checkpoint(weights, run)


def _is_weights_dir(path: str) -> bool:
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
    return data if isinstance(data, dict) and "runtime" in data and "model" in data else None


def export(src: str, out: str, shard_bytes: int = DEFAULT_SHARD_BYTES, dtype: str | None = None,
           tokenizer: str | None = None) -> dict:
    """Write ``src`` (a run or checkpoint directory) to ``out`` as a loadable HF checkpoint.

    Tensors are re-sharded to ``shard_bytes`` and optionally cast to ``dtype`` (float32, bfloat16,
    float16); the tokenizer is ``tokenizer`` (a directory), else :attr:`Checkpoint.tokenizer`.
    Returns a summary (paths, tensor count, bytes, tokenizer and config files written).
    """
    from safetensors import safe_open

    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    if shard_bytes <= 0:
        raise ConfigError(f"--shard-size must be positive, got {shard_bytes}.")
    if tokenizer is not None and not is_tokenizer_dir(tokenizer):
        raise ConfigError(f"--tokenizer {tokenizer!r} holds no tokenizer.json, tokenizer.model or vocab.json.")
    ckpt = resolve_checkpoint(src)
    if os.path.abspath(out) == os.path.abspath(ckpt.weights_dir):
        raise ConfigError(f"--out {out!r} is the checkpoint being exported; choose another directory.")
    if os.path.isdir(out) and os.listdir(out):
        raise ConfigError(f"--out {out!r} exists and is not empty; choose a new directory.")
    cfg, raw = read_config(ckpt.weights_dir)
    mapping = weight_map(ckpt.weights_dir)
    check_tensors(cfg, mapping, ckpt.weights_dir, "the checkpoint")
    with safe_open(os.path.join(ckpt.weights_dir, mapping[hf_name("embed", "weight")]), framework="pt") as f:
        stored = f.get_slice(hf_name("embed", "weight")).get_dtype()
    target = DTYPES[dtype] if dtype else _safetensors_dtype(stored)

    def reader(key: str) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            with safe_open(os.path.join(ckpt.weights_dir, mapping[key]), framework="pt") as f:
                return f.get_tensor(key).to(target)
        return load

    names = list(expected_names(cfg))
    shapes = _shapes(ckpt.weights_dir, {k: mapping[k] for k in names})
    tensors = [TensorSource(key, _numel(shapes[key]) * target.itemsize, reader(key)) for key in names]
    os.makedirs(out, exist_ok=True)
    new_map = write_shards(out, tensors, shard_bytes)
    tok = tokenizer or ckpt.tokenizer
    write_json(os.path.join(out, "config.json"), hf_config(cfg, target, raw, tok))
    copied = copy_side_files(ckpt.weights_dir, out, EXTRA_FILES)
    copied += write_tokenizer(tok, out)
    return {"out": out, "source": ckpt.weights_dir, "tensors": len(names),
            "shards": len(set(new_map.values())), "bytes": sum(t.nbytes for t in tensors),
            "dtype": str(target).removeprefix("torch."), "copied": copied}


def _shapes(directory: str, mapping: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the named tensors, from the shard headers (no tensor is read)."""
    from safetensors import safe_open

    out = {}
    for filename in sorted(set(mapping.values())):
        with safe_open(os.path.join(directory, filename), framework="pt") as f:
            for key in (k for k, v in mapping.items() if v == filename):
                out[key] = tuple(f.get_slice(key).get_shape())
    return out


def _safetensors_dtype(name: str) -> torch.dtype:
    table = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    if name not in table:
        raise ConfigError(f"the checkpoint stores weights as {name}; only F32, BF16 and F16 are supported.")
    return table[name]
