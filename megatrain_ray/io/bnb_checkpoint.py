"""A bitsandbytes 4-bit checkpoint directory (transformers' ``save_pretrained`` of a model loaded with
``BitsAndBytesConfig(load_in_4bit=True, ...)``) read into an nf4 base as it is.

Its config.json carries ``quantization_config`` (``quant_method: bitsandbytes``); each quantized
``Linear`` weight is its packed codes under the weight's name plus ``.absmax`` (the absmax codes),
``.nested_absmax`` (absmax2), ``.quant_map``, ``.nested_quant_map`` and the JSON
``.quant_state.bitsandbytes__nf4`` (shape, blocksize, ``nested_offset``). A LoRA run with
lora.base_format nf4 takes those bytes into its records unchanged (:func:`load_into`): the codes the
user holds are the ones trained on. A weight it stores quantized but the checkpoint does not (a
module bitsandbytes skipped) is quantized as it is read; one the checkpoint quantized but it keeps
raw (a router) is dequantized (:mod:`megatrain_ray.model.quant`, bitsandbytes' arithmetic).
"""

from __future__ import annotations

import json
import math
import os

import torch

from ..config import ModelConfig, TrainConfig
from ..errors import ConfigError
from ..model.quant import NF4_BLOCK, NF4_LEVELS, PAD_BYTE, STATS_BLOCK, dequantize_nf4, dynamic_map, nf4_bytes
from ..model.quant_layout import NF4
from . import hf_io

STATE_SUFFIX = ".quant_state.bitsandbytes__nf4"
PARTS = (".absmax", ".nested_absmax", ".quant_map", ".nested_quant_map", STATE_SUFFIX)
"""What a quantized weight adds to its name in the checkpoint."""


def quantization(directory: str | None) -> dict | None:
    """The bitsandbytes ``quantization_config`` of an HF directory's config.json, or None."""
    if directory is None or not os.path.isfile(os.path.join(directory, "config.json")):
        return None
    q = hf_io.read_config(directory, "train.init_from")[1].get("quantization_config")
    return q if isinstance(q, dict) and q.get("quant_method") == "bitsandbytes" else None


def check(cfg: TrainConfig) -> None:
    """train.init_from, where it is a bitsandbytes checkpoint, as a run can read it: one ConfigError naming the fix."""
    q = quantization(cfg.train.init_from)
    if q is None:
        return
    what = f"train.init_from ({cfg.train.init_from}) is a bitsandbytes-quantized checkpoint"
    if not q.get("load_in_4bit") or q.get("bnb_4bit_quant_type") != "nf4" or not q.get("bnb_4bit_use_double_quant"):
        raise ConfigError(f"{what} in another format than nf4 with double quantization ({q}); only that one is read "
                          "as it is: start from the unquantized checkpoint and set lora.base_format.")
    if cfg.lora.base_format != NF4 or not cfg.lora.enabled:
        raise ConfigError(f"{what} (nf4); set lora.rank > 0 and lora.base_format=nf4 to train adapters on it as it is.")
    check_weights(cfg.model, cfg.train.init_from)


def _entries(cfg: ModelConfig, directory: str) -> tuple[dict[str, str], dict[str, tuple[str, tuple[int, ...]]]]:
    """(weight map, {tensor: (dtype, shape)} of its headers)."""
    mapping = hf_io.weight_map(directory, "train.init_from")
    headers = {}
    for filename in sorted(set(mapping.values())):
        headers.update(hf_io._header(directory, filename, "train.init_from"))
    return mapping, headers


def check_weights(cfg: ModelConfig, directory: str) -> dict[str, str]:
    """Every parameter of ``cfg`` there, unquantized with its shape or quantized with its parts (headers
    only); one ConfigError naming the tensor otherwise. Returns the weight map."""
    mapping, headers = _entries(cfg, directory)
    for key, shape in hf_io.expected_shapes(cfg).items():
        if key not in headers:
            if key == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            raise ConfigError(f"train.init_from ({directory}) lacks the tensor {key} that a {cfg.model_type} model "
                              "of its config.json has (stacked experts are not read from a bitsandbytes checkpoint).")
        if key + ".absmax" in headers:
            missing = [key + p for p in PARTS if key + p not in headers]
            if missing:
                raise ConfigError(f"train.init_from ({directory}) holds {key} quantized without {missing[0]}; save "
                                  "the model again with save_pretrained.")
        elif tuple(headers[key][1]) != tuple(shape):
            raise ConfigError(f"tensor {key} in train.init_from ({directory}) has shape {headers[key][1]}, but its "
                              f"config.json implies {tuple(shape)}.")
    return mapping


def _state(f, key: str) -> dict:
    return json.loads(bytes(f.get_tensor(key + STATE_SUFFIX).tolist()).decode())


def read_nf4(f, key: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, absmax codes, absmax2, offset) of a quantized weight in an open safetensors file ``f``, in
    :func:`megatrain_ray.model.quant.quantize_nf4`'s form; a ConfigError where its state is another layout."""
    state = _state(f, key)
    n = math.prod(shape)
    if (state.get("quant_type") != "nf4" or state.get("blocksize") != NF4_BLOCK or "nested_offset" not in state
            or state.get("nested_blocksize") != STATS_BLOCK or math.prod(state.get("shape", ())) != n):
        raise ConfigError(f"{key} in train.init_from is quantized as {state}, not nf4 in blocks of {NF4_BLOCK} with "
                          f"double quantization in blocks of {STATS_BLOCK} of shape {shape}.")
    if not (torch.equal(f.get_tensor(key + ".quant_map").float(), torch.tensor(NF4_LEVELS))
            and torch.equal(f.get_tensor(key + ".nested_quant_map").float(), dynamic_map())):
        raise ConfigError(f"{key} in train.init_from has code tables other than bitsandbytes' nf4 and dynamic maps.")
    size, blocks, stats = nf4_bytes(n)
    packed = f.get_tensor(key).reshape(-1).view(torch.uint8)
    codes = torch.full((size,), PAD_BYTE, dtype=torch.uint8)
    codes[:packed.numel()] = packed
    qabsmax, absmax2 = f.get_tensor(key + ".absmax").reshape(-1), f.get_tensor(key + ".nested_absmax").reshape(-1)
    if packed.numel() != -(-n // 2) or qabsmax.numel() != blocks or absmax2.numel() != stats:
        raise ConfigError(f"{key} in train.init_from has {packed.numel()} code bytes, {qabsmax.numel()} absmax and "
                          f"{absmax2.numel()} nested absmax, not the {-(-n // 2)}, {blocks}, {stats} of shape {shape}.")
    offset = torch.tensor([state["nested_offset"]], dtype=torch.float32)
    return codes, qabsmax.to(torch.uint8), absmax2.float(), offset


def load_into(store, directory: str) -> None:
    """Read a bitsandbytes 4-bit checkpoint into ``store`` (a HostStore of an nf4 base; see the module docstring)."""
    from safetensors import safe_open

    cfg, base = store.spec.model, store.base
    if base is None or base.layout.fmt != NF4:
        raise ConfigError(f"train.init_from ({directory}) is a bitsandbytes 4-bit checkpoint; set lora.rank > 0 and "
                          "lora.base_format=nf4 to train adapters on it as it is.")
    mapping = check_weights(cfg, directory)
    units = store.layout.units
    for key, (unit, name) in sorted(hf_io.expected_names(cfg).items(), key=lambda kv: (mapping.get(kv[0], ""), kv[0])):
        if key not in mapping:  # a tied head
            continue
        i = units.index(unit)
        with safe_open(os.path.join(directory, mapping[key]), framework="pt") as f:
            if key + ".absmax" not in mapping:
                store.write(i, name, f.get_tensor(key))
                continue
            record = base.record(i, name)
            arrays = read_nf4(f, key, record.shape)
            if record.fmt == NF4:
                base.write_pieces(i, name, arrays)
            else:  # kept raw here: bitsandbytes' weight, dequantized
                store.write(i, name, dequantize_nf4(*arrays, torch.empty(record.numel, dtype=torch.float32)))
