"""LoRA adapters out: a PEFT adapter directory, and the full model with the adapters merged in.

The adapter directory is what ``peft.PeftModel.save_pretrained`` writes and ``PeftModel.from_pretrained``
loads on top of the base model: ``adapter_config.json`` (a ``LoraConfig``: r, lora_alpha, target
modules, modules_to_save, ...) and ``adapter_model.safetensors``, whose keys are PEFT's
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``; the embedding or LM head
trained in full under ``base_model.model.`` + its HF name). The merged model is a plain Hugging
Face directory (:mod:`.hf_io`'s format) whose targeted weights are W + scaling * B A
(:func:`~megatrain_ray.model.lora.merged_weight`), loadable with ``AutoModelForCausalLM`` alone.

Both directories appear whole or not at all (:func:`~megatrain_ray.io.files.atomic_dir`); tensors
are loaded one at a time as they are written.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from ..config import LoraSection, ModelConfig
from ..model.lora import PEFT_PREFIX, AdapterLayout, merged_weight, peft_name
from ..model.transformer import hf_name, unit_names, unit_params
from .files import TensorSource, atomic_dir, write_json, write_safetensors
from .generation import write_generation_config
from .hf_io import DEFAULT_SHARD_BYTES, write_model_dir

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

BaseReader = Callable[[str, str], torch.Tensor]
"""(unit, name relative to the unit) -> that base tensor (read when called)."""


def full_names(cfg: ModelConfig, lora: LoraSection) -> list[str]:
    """The HF names of the base tensors lora trains in full (the embedding, the LM head)."""
    return ([hf_name("embed", "weight")] if lora.train_embedding else []) + (
        [hf_name("head", "lm_head.weight")] if lora.train_head and not cfg.tie_word_embeddings else [])


def _full_keys(cfg: ModelConfig, lora: LoraSection) -> list[tuple[str, str]]:
    """(key in adapter_model.safetensors, HF name) of each tensor trained in full; a tied embedding is
    saved under the LM head's key too, as PEFT saves it with ``ensure_weight_tying``."""
    out = [(PEFT_PREFIX + name, name) for name in full_names(cfg, lora)]
    if lora.train_embedding and cfg.tie_word_embeddings:
        out.append((PEFT_PREFIX + hf_name("head", "lm_head.weight"), hf_name("embed", "weight")))
    return out


def adapter_config(cfg: ModelConfig, lora: LoraSection, base_model: str | None = None) -> dict:
    """adapter_config.json of these adapters: the fields of PEFT's LoraConfig that describe them
    (PEFT fills the rest with its defaults when it loads the file)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "use_rslora": lora.use_rslora,
            "target_modules": list(lora.target_modules), "bias": "none", "fan_in_fan_out": False,
            "init_lora_weights": True, "inference_mode": True, "use_dora": False,
            "modules_to_save": list(lora.modules_to_save) or None,
            "ensure_weight_tying": bool(lora.train_embedding and cfg.tie_word_embeddings)}


def save_adapters(out: str, cfg: ModelConfig, lora: LoraSection, adapters: dict[str, torch.Tensor],
                  full: dict[str, torch.Tensor] | None = None, base_model: str | None = None,
                  dtype: torch.dtype | None = None, tokenizer: str | None = None) -> dict:
    """Write a PEFT adapter directory at ``out``. adapters: {unit: its adapters' flat buffer [numel]}
    (:class:`~megatrain_ray.model.lora.AdapterLayout`); full: {HF name: tensor} of the base tensors
    trained in full (:func:`full_names`); base_model: the base's directory or hub id, for
    adapter_config.json; dtype: of the written tensors (None: as given); tokenizer: the run's, whose
    chat template's end of turn joins the base's generation_config.json written beside the adapters
    (:func:`~megatrain_ray.io.generation.write_generation_config`: PEFT loads the base's, so
    ``generate`` stops at the end of a turn with ``generation_config=GenerationConfig.from_pretrained``
    of this directory). Returns a summary."""
    layout = AdapterLayout.build(cfg, lora)
    tensors = []
    for unit, template in zip(layout.units, layout.templates):
        for name, t in template.bind(adapters[unit]).items():
            tensors.append(TensorSource.of(peft_name(unit, name), t if dtype is None else t.to(dtype)))
    for key, name in _full_keys(cfg, lora):
        tensors.append(TensorSource.of(key, full[name] if dtype is None else full[name].to(dtype)))
    nbytes = sum(t.nbytes for t in tensors)
    with atomic_dir(out, "the adapters", nbytes) as tmp:
        write_safetensors(os.path.join(tmp, ADAPTER_WEIGHTS), tensors)
        write_json(os.path.join(tmp, ADAPTER_CONFIG), adapter_config(cfg, lora, base_model))
        write_generation_config(base_model, tmp, tokenizer)
    return {"out": out, "tensors": len(tensors), "bytes": nbytes}


def save_merged(out: str, cfg: ModelConfig, lora: LoraSection, adapters: dict[str, torch.Tensor], base: BaseReader,
                dtype: torch.dtype, full: dict[str, torch.Tensor] | None = None, source: str | None = None,
                tokenizer: str | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """Write the base with the adapters merged in as an HF model directory at ``out``, in ``dtype``.

    adapters, full: as :func:`save_adapters`; base: reads each base tensor; source: the HF directory
    the base came from (its config.json's other fields and generation config are kept); tokenizer:
    the run's (see :func:`megatrain_ray.io.hf_io.write_tokenizer`). Returns the shard file names.
    """
    layout = AdapterLayout.build(cfg, lora)
    full = full or {}

    def reader(unit: str, name: str) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            key = hf_name(unit, name)
            if key in full:
                return full[key].to(dtype)
            weight = base(unit, name)
            template = layout.template(unit)
            p = {} if template is None else template.bind(adapters[unit])
            module = name.removesuffix(".weight")
            if f"{module}.lora_A.weight" not in p:
                return weight.to(dtype)
            return merged_weight(weight.float(), p[f"{module}.lora_A.weight"], p[f"{module}.lora_B.weight"],
                                 layout.scaling).to(dtype)
        return load

    tensors = [TensorSource(hf_name(unit, name), tuple(shape), dtype, reader(unit, name))
               for unit in unit_names(cfg) for name, shape in unit_params(cfg, unit)]
    return write_model_dir(out, "the merged weights", cfg, dtype, tensors, shard_bytes, source, tokenizer)
