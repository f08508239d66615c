"""Hugging Face checkpoints in and out: import into the host store, export from it or from a run.

The on-disk format is the one ``transformers`` writes and reads: ``config.json``, sharded
``model-0000k-of-0000n.safetensors`` files with a ``model.safetensors.index.json`` (or a single
``model.safetensors``), and the tokenizer files next to them. A written directory carries the
tokenizer the run used (a copy of its directory, or the byte-level one written as a Hugging Face
tokenizer) and config.json names its end-of-text and beginning-of-text ids (``eos_token_id``,
``bos_token_id``: the source model's where it had them, else the tokenizer's), so ``generate``
stops at EOS. Files get the mode a plain ``open`` would give them (0o666 less the umask).

Mixtures of experts: a checkpoint holds each routed expert's projections as tensors of their own
(the Hub's form, ``mlp.experts.{e}.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.{e}.w1.weight``,
which transformers 4 and 5 both load and 5 writes), or all of a layer's experts stacked in 3-D
tensors (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]: transformers
5's parameters, as a state dict saved directly holds them). Import reads either, layer by layer
(:func:`megatrain_ray.io.experts.sources`; a stacked tensor is read one expert's slice at a time); export writes
the Hub's form (gpt-oss's: stacked, its MXFP4 experts dequantized; :mod:`megatrain_ray.io.gpt_oss`).

Memory policy, for every direction: tensors move one at a time. Import reads the shards in order
through safetensors' memory mapping and copies each tensor straight into its place in the store's
master block, under a mapping of its own (see :func:`load_into`); no torch model and no second
full copy of the weights is ever built, and the peak above the store is one tensor (measured by
the tests). Export materialises at most one shard of tensors (``shard_bytes``) before writing it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterable

import torch

from ..config import ARCHITECTURES, SUPPORTED_MODEL_TYPES, ModelConfig, TrainConfig, load_config, unwritable
from ..data.tokenizer import BYTE_LEVEL, TOKENIZER_FILES, is_tokenizer_dir, load_tokenizer, save_byte_tokenizer
from ..errors import ConfigError, DataError
from ..model.transformer import hf_name
from .experts import read_source, reader, source_keys, source_shapes, sources, write_source
from .files import TORCH_DTYPES, CorruptFile, TensorSource, atomic_dir, read_header, write_json, write_shards
from .generation import write_generation_config
from .locate import INDEX_FILE, SINGLE_FILE, resolve_checkpoint
from .gpt_oss import hub_form

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


def load_train_config(path: str | None = None, overrides: list[str] = (), base: dict | None = None,
                      skip: tuple[str, ...] = ()) -> TrainConfig:
    """:func:`megatrain_ray.config.load_config`, with ``train.init_from``'s config.json as the model
    shape; a model.* value the configuration sets that disagrees with it is a ConfigError naming the key."""
    return load_config(path, overrides, base, model_from=_init_from_model, skip=skip)


def _init_from_model(directory: str, given: dict) -> ModelConfig:
    model = read_config(directory, "train.init_from")[0]
    if model.tie_word_embeddings and _separate_head(directory):
        if given.get("tie_word_embeddings") is not False:
            raise ConfigError(f"train.init_from's config.json ({directory}) sets tie_word_embeddings: true, but "
                              "its weights hold an lm_head.weight unlike model.embed_tokens.weight; set "
                              "model.tie_word_embeddings=false to train that head (transformers loads this "
                              "directory untied too), or remove lm_head.weight from the files to tie it.")
        model = dataclasses.replace(model, tie_word_embeddings=False)  # the user's choice: the head the files hold
        given = {k: v for k, v in given.items() if k != "tie_word_embeddings"}
    for key, value in given.items():
        theirs = getattr(model, key)
        if value != theirs:
            raise ConfigError(f"model.{key} ({value!r}) disagrees with train.init_from's config.json "
                              f"({directory}: {theirs!r}), which defines the model; remove model.{key} from the "
                              "configuration, or point train.init_from at the model meant.")
    return model


def _separate_head(directory: str, rows: int = 4096) -> bool:
    """Whether an HF directory holds an ``lm_head.weight`` that is not a copy of the embedding (read
    ``rows`` rows of each at a time): a config.json that ties them beside such a file is the wrong one."""
    from safetensors import safe_open

    mapping = weight_map(directory, "train.init_from")
    head, embed = "lm_head.weight", hf_name("embed", "weight")
    if head not in mapping or embed not in mapping:
        return False
    with safe_open(os.path.join(directory, mapping[head]), framework="pt") as h, \
            safe_open(os.path.join(directory, mapping[embed]), framework="pt") as e:
        a, b = h.get_slice(head), e.get_slice(embed)
        if a.get_shape() != b.get_shape():
            return True
        return any(not torch.equal(a[i:i + rows], b[i:i + rows]) for i in range(0, a.get_shape()[0], rows))


def weight_map(directory: str, what: str = "the checkpoint") -> dict[str, str]:
    """{tensor name: shard file name} of an HF model directory (sharded with an index, or single-file)."""
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
        return {k: SINGLE_FILE for k in _header(directory, SINGLE_FILE, what)}
    raise ConfigError(f"{what} ({directory}) holds neither {SINGLE_FILE} nor {INDEX_FILE}; "
                      "PyTorch .bin checkpoints are not supported, re-save it with safe_serialization.")


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    """Tensors an HF checkpoint may carry that the model does not use (GLM's MTP layers: ``beyond_layers``)."""
    return cfg.beyond_layers(name) or name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and cfg.tie_word_embeddings)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{full HF name: shape} of every parameter the model has, in unit order."""
    from ..model.transformer import unit_names, unit_params

    return {hf_name(unit, name): tuple(shape) for unit in unit_names(cfg) for name, shape in unit_params(cfg, unit)}


def expected_names(cfg: ModelConfig) -> dict[str, tuple[str, str]]:
    """{full HF name: (unit, name relative to the unit)} of every parameter the model has."""
    from ..model.transformer import unit_names, unit_params

    return {hf_name(unit, name): (unit, name) for unit in unit_names(cfg) for name, _ in unit_params(cfg, unit)}


def check_tensors(cfg: ModelConfig, mapping: dict[str, str], directory: str, what: str) -> None:
    """Missing or unexpected tensors are one ConfigError naming them."""
    wanted = {key for source in sources(cfg, mapping, expected_names(cfg)).values() for key in source_keys(source)}
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


def _header(directory: str, filename: str, what: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """:func:`megatrain_ray.io.files.read_header` of one file of a model directory, as a ConfigError."""
    try:
        return read_header(os.path.join(directory, filename))
    except CorruptFile as e:
        raise ConfigError(f"{what}'s {filename} in {directory!r} is missing or corrupt ({e}); re-save the "
                          "model (save_pretrained) or export it again.") from None


def check_weights(cfg: ModelConfig, directory: str, what: str) -> dict[str, str]:
    """The weight map of an HF directory holding ``cfg``'s weights, after checking (headers only) that
    every tensor is there, with the shape ``cfg`` gives it, in a sound safetensors file; a ConfigError
    names the file or tensor otherwise. Returns the weight map."""
    mapping = weight_map(directory, what)
    check_tensors(cfg, mapping, directory, what)
    want = source_shapes(cfg, sources(cfg, mapping, expected_names(cfg)), expected_shapes(cfg))
    for filename in sorted({mapping[k] for k in want}):
        found = _header(directory, filename, what)
        for key in (k for k in want if mapping[k] == filename):
            if key not in found:
                raise ConfigError(f"{what}'s {filename} in {directory!r} lacks the tensor {key} that its index "
                                  "names.")
            if found[key][1] != want[key]:
                raise ConfigError(f"tensor {key} in {what} ({directory}) has shape {found[key][1]}, but its "
                                  f"config.json implies {want[key]}.")
    return mapping


def load_into(store, directory: str, what: str = "train.init_from") -> None:
    """Copy an HF checkpoint into ``store``'s master blocks (a HostStore; quantized as it is written, for a
    quantized base), then refresh stream copies.

    Shards are read in order through safetensors' memory mapping, and each tensor is copied into
    its view of the store (converting dtype on the way) under a mapping of its own: pages of a
    mapped file count as the process's memory until it is unmapped, so holding a whole shard mapped
    would add up to a shard's size; this way the peak on top of the store is the largest tensor.
    Every shape is checked against the config before the first byte is copied.
    """
    from safetensors import safe_open

    cfg = store.spec.model
    mapping = check_weights(cfg, directory, what)
    where = sources(cfg, mapping, expected_names(cfg))
    units, read = store.layout.units, reader(directory, mapping)
    for key, (unit, name) in sorted(expected_names(cfg).items(), key=lambda kv: (mapping[where[kv[0]][0]], kv[0])):
        with safe_open(os.path.join(directory, mapping[where[key][0]]), framework="pt") as f:
            write_source(store, units.index(unit), name, f, where[key], read)
    for i in range(len(units)):
        store.refresh_stream(i)


def read_unit(directory: str, mapping: dict[str, str], cfg: ModelConfig, unit: str,
              dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """One unit's parameters (names relative to the unit) read from an HF directory, as ``dtype``."""
    from safetensors import safe_open

    from ..model.transformer import unit_params

    out, by_file, where, read = {}, {}, sources(cfg, mapping, expected_names(cfg)), reader(directory, mapping)
    for name, _ in unit_params(cfg, unit):
        source = where[hf_name(unit, name)]
        by_file.setdefault(mapping[source[0]], []).append((source, name))
    for filename, entries in by_file.items():
        with safe_open(os.path.join(directory, filename), framework="pt") as f:
            for source, name in entries:
                out[name] = read_source(f, source, read).to(dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Writing a model directory.

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

    ``source`` is the HF directory the run started from (train.init_from) or None: its config.json's
    other fields and its generation_config.json are kept. ``tokenizer`` is the run's (a directory,
    BYTE_LEVEL, or None: none written). The directory appears whole or not at all (see
    :func:`megatrain_ray.io.files.atomic_dir`): a full disk removes what was written and raises one
    WriteError naming it and the space needed. Tensors are written straight from the store's memory.
    """
    tensors = hub_form(store.spec.model, [TensorSource.of(hf_name(unit, name), store.params("master", i)[name])
                       for i, unit in enumerate(store.layout.units) for name, _, _ in store.layout.templates[i].params])
    return write_model_dir(directory, "the final weights", store.spec.model, store.spec.precision.master, tensors,
                           shard_bytes, source, tokenizer)


def write_model_dir(directory: str, what: str, cfg: ModelConfig, dtype: torch.dtype, tensors: list[TensorSource],
                    shard_bytes: int = DEFAULT_SHARD_BYTES, source: str | None = None,
                    tokenizer: str | None = None) -> list[str]:
    """An HF model directory of ``tensors`` (in ``dtype``) with config.json for ``cfg``, ``source``'s
    other config.json fields and generation config, and ``tokenizer`` (see :func:`save_store`),
    appearing whole or not at all (``what``: how its user knows it, for errors); its shard files."""
    base = None
    if source is not None and os.path.isfile(os.path.join(source, "config.json")):
        base = read_config(source, "train.init_from")[1]
        base.pop("quantization_config", None)  # the weights written are not (a quantized base's: dequantized)
    with atomic_dir(directory, what, sum(t.nbytes for t in tensors)) as tmp:
        mapping, _ = write_shards(tmp, "model", INDEX_FILE, tensors, shard_bytes)
        write_json(os.path.join(tmp, "config.json"), hf_config(cfg, dtype, base, tokenizer))
        write_generation_config(source, tmp, tokenizer)
        write_tokenizer(tokenizer, tmp)
    return sorted(set(mapping.values()))


# ---------------------------------------------------------------------------------------------
# Export of a finished run or a checkpoint directory.

def export(src: str, out: str, shard_bytes: int = DEFAULT_SHARD_BYTES, dtype: str | None = None,
           tokenizer: str | None = None) -> dict:
    """Write ``src`` (a run or checkpoint directory) to ``out`` as a loadable HF checkpoint.

    Tensors are re-sharded to ``shard_bytes`` and optionally cast to ``dtype`` (float32, bfloat16,
    float16); the tokenizer is ``tokenizer`` (a directory), else :attr:`Checkpoint.tokenizer`.
    ``out`` appears whole or not at all (see :func:`megatrain_ray.io.files.atomic_dir`); one tensor
    is in memory at a time. Returns a summary (paths, tensor count, bytes, tokenizer and config files
    written).
    """
    from safetensors import safe_open

    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    if shard_bytes <= 0:
        raise ConfigError(f"--shard-size must be positive, got {shard_bytes}.")
    if tokenizer is not None and not is_tokenizer_dir(tokenizer):
        raise ConfigError(f"--tokenizer {tokenizer!r} holds no tokenizer.json, tokenizer.model or vocab.json.")
    if os.path.abspath(out) == os.path.abspath(src):
        raise ConfigError(f"--out {out!r} is the checkpoint being exported; choose another directory.")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out {out!r} is a file; choose a new directory.")
    if os.path.isdir(out) and os.listdir(out):
        raise ConfigError(f"--out {out!r} exists and is not empty; choose a new directory.")
    why = unwritable(os.path.dirname(os.path.abspath(out)))
    if why:  # said before the checkpoint is read and checked, which takes a while for a large one
        raise ConfigError(f"--out {out!r} cannot be written to ({why}); choose a writable directory.")
    ckpt = resolve_checkpoint(src)
    cfg, raw = read_config(ckpt.weights_dir)
    raw.pop("quantization_config", None)  # the weights written are not quantized (MXFP4 experts: dequantized)
    mapping = check_weights(cfg, ckpt.weights_dir, "the checkpoint")
    embed = hf_name("embed", "weight")
    stored = _header(ckpt.weights_dir, mapping[embed], "the checkpoint")[embed][0]
    if dtype is None and stored not in TORCH_DTYPES:
        raise ConfigError(f"the checkpoint stores weights as {stored}; only F32, BF16 and F16 are supported.")
    target = DTYPES[dtype] if dtype else TORCH_DTYPES[stored]
    where = sources(cfg, mapping, expected_names(cfg))  # a stacked-experts checkpoint is written in the per-expert form

    def param(key: str) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            with safe_open(os.path.join(ckpt.weights_dir, mapping[where[key][0]]), framework="pt") as f:
                return read_source(f, where[key], reader(ckpt.weights_dir, mapping)).contiguous().to(target)
        return load

    tensors = hub_form(cfg, [TensorSource(key, shape, target, param(key)) for key, shape in expected_shapes(cfg).items()])
    nbytes = sum(t.nbytes for t in tensors)
    tok = tokenizer or ckpt.tokenizer
    with atomic_dir(out, "--out", nbytes) as tmp:
        new_map, _ = write_shards(tmp, "model", INDEX_FILE, tensors, shard_bytes)
        write_json(os.path.join(tmp, "config.json"), hf_config(cfg, target, raw, tok))
        copied = write_generation_config(ckpt.weights_dir, tmp, tok)
        copied += write_tokenizer(tok, tmp)
    return {"out": out, "source": ckpt.weights_dir, "tensors": len(tensors),
            "shards": len(set(new_map.values())), "bytes": nbytes,
            "dtype": str(target).removeprefix("torch."), "copied": copied}
