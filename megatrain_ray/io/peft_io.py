"""LoRA adapters out: a PEFT adapter directory, and the full model with the adapters merged in.

The adapter directory is what ``peft.PeftModel.save_pretrained`` writes and ``PeftModel.from_pretrained``
loads on top of the base model: ``adapter_config.json`` (a ``LoraConfig``: r, lora_alpha, target
modules, modules_to_save, ...) and ``adapter_model.safetensors``, whose keys are PEFT's
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``; the embedding or LM head
trained in full under ``base_model.model.`` + its HF name; a mixture of experts' routed experts'
adapters as PEFT's ``target_parameters`` saves them, :func:`peft_tensors`). The merged model is a plain Hugging
Face directory (:mod:`.hf_io`'s format) whose targeted weights are W + scaling * B A
(:func:`~megatrain_ray.model.lora.merged_weight`; each routed expert's in the Hub's per-expert
tensors, :func:`~megatrain_ray.model.lora.expert_merged_weight`), loadable with ``AutoModelForCausalLM`` alone.

Both directories appear whole or not at all (:func:`~megatrain_ray.io.files.atomic_dir`); tensors
are loaded one at a time as they are written.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from ..config import LoraSection, ModelConfig
from ..model import moe
from ..model.lora import (PEFT_PREFIX, AdapterLayout, expert_merged_weight, expert_modules, merged_weight, peft_name,
                          projection_name)
from ..model.transformer import hf_name, unit_names, unit_params
from .files import TensorSource, atomic_dir, write_json, write_safetensors
from .generation import write_generation_config
from .gpt_oss import hub_form, interleave
from .hf_io import DEFAULT_SHARD_BYTES, write_model_dir

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

RUNTIME_BLOCK = "mlp"
"""The module of a sparse layer's experts and router in transformers 5's models, Mixtral's included
(whose Hub checkpoints say ``block_sparse_moe``): PEFT's keys name the modules as they run."""

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


def target_parameters(cfg: ModelConfig, lora: LoraSection) -> list[str]:
    """PEFT's ``target_parameters`` of these adapters: transformers' names of the routed experts'
    stacked parameters that carry adapters (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``,
    in that order; Mixtral's too, whose experts transformers 5 holds under ``mlp``); [] for a dense model."""
    if not cfg.sparse_layers:
        return []
    return [f"{RUNTIME_BLOCK}.experts.{target}" for target, _, _ in expert_modules(cfg, lora)]


def target_modules(cfg: ModelConfig, lora: LoraSection) -> list[str]:
    """PEFT's ``target_modules`` of these adapters: those of lora.target_modules that some decoder
    layer of ``cfg`` has (a mixture of experts without dense MLP layers has no ``down_proj`` module
    but its experts', which :func:`target_parameters` names), in lora's order."""
    layout = AdapterLayout.build(cfg, lora)
    present = {projection_name(name.replace(".lora_A.weight", ".weight")) for t in layout.templates
               for name, _, _ in t.params if name.endswith(".lora_A.weight")}
    return [m for m in lora.target_modules if m in present]


def adapter_config(cfg: ModelConfig, lora: LoraSection, base_model: str | None = None) -> dict:
    """adapter_config.json of these adapters: the fields of PEFT's LoraConfig that describe them
    (PEFT fills the rest with its defaults when it loads the file)."""
    out = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
           "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "use_rslora": lora.use_rslora,
           "target_modules": target_modules(cfg, lora) or None, "bias": "none", "fan_in_fan_out": False,
           "init_lora_weights": True, "inference_mode": True, "use_dora": False,
           "modules_to_save": list(lora.modules_to_save) or None,
           "ensure_weight_tying": bool(lora.train_embedding and cfg.tie_word_embeddings)}
    if target_parameters(cfg, lora):  # PEFT 0.17+ (written only where there are experts)
        out["target_parameters"] = target_parameters(cfg, lora)
    return out


def peft_tensors(cfg: ModelConfig, lora: LoraSection, unit: str, views: dict[str, torch.Tensor]
                 ) -> list[tuple[str, torch.Tensor]]:
    """(key in PEFT's adapter_model.safetensors, tensor) of each of ``unit``'s adapter ``views``
    (:meth:`~megatrain_ray.model.lora.AdapterLayout.bind`'s names). A dense adapter is saved as it is
    under :func:`~megatrain_ray.model.lora.peft_name`. A routed experts' adapter is saved as PEFT's
    ``ParamWrapper`` holds it, on transformers' ``mlp.experts`` module: A [E, r, in] as one
    [E * r, in] matrix, B [E, out, r] as one [out, r * E] matrix whose column j * E + e is expert e's
    column j (gpt-oss's gate_up_proj B with its rows first interleaved gate/up,
    :func:`~megatrain_ray.io.gpt_oss.interleave`, as transformers' ``gate_up_proj`` [E, H, 2I]
    orders the out features PEFT's B rows stand for); each targeted parameter wraps the one before
    it, so the first of :func:`target_parameters` sits deepest (``mlp.experts.base_layer.lora_A.weight`` of gate_up_proj beside down_proj's
    ``mlp.experts.lora_A.weight``). A router trained in full is saved under transformers' module name
    (``mlp.gate.weight``), as PEFT's modules_to_save."""
    experts = expert_modules(cfg, lora)
    where = {module: len(experts) - 1 - k for k, (_, module, _) in enumerate(experts)}
    router, gate_up = moe.names(cfg).router, moe.names(cfg).stacked[0]
    out = []
    for name, t in views.items():
        if name.endswith(".lora_scaling"):
            continue
        module, _, kind = name.rpartition(".lora_")
        if module in where:
            prefix = f"{PEFT_PREFIX}model.{unit}.{RUNTIME_BLOCK}.experts.{'base_layer.' * where[module]}"
            if kind == "A.weight":
                out.append((prefix + "lora_A.weight", t.reshape(-1, t.shape[-1])))
            else:
                if module == gate_up and cfg.model_type == "gpt_oss":  # the Hub's interleaved gate/up rows
                    t = interleave(t, 1)
                out.append((prefix + "lora_B.weight", t.permute(1, 2, 0).reshape(t.shape[1], -1)))
        elif name == router:
            out.append((f"{PEFT_PREFIX}model.{unit}.{RUNTIME_BLOCK}.gate.weight", t))
        else:
            out.append((peft_name(unit, name), t))
    return out


def router_companions(cfg: ModelConfig, lora: LoraSection) -> list[tuple[str, str, str]]:
    """(key in adapter_model.safetensors, unit, name in the unit) of the frozen base tensors PEFT saves
    beside a router trained in full: its modules_to_save holds the router's whole module, so GLM's
    score-correction bias (``mlp.gate.e_score_correction_bias``, a buffer of that module) is saved
    with its weight and must be there when PEFT loads the file; [] without lora.train_router or bias."""
    if not lora.train_router or cfg.router_scoring != "sigmoid":
        return []
    bias = moe.names(cfg).score_bias
    return [(f"{PEFT_PREFIX}model.layers.{i}.{RUNTIME_BLOCK}.gate.{bias.rpartition('.')[2]}", f"layers.{i}", bias)
            for i in cfg.sparse_layers]


def save_adapters(out: str, cfg: ModelConfig, lora: LoraSection, adapters: dict[str, torch.Tensor],
                  full: dict[str, torch.Tensor] | None = None, base_model: str | None = None,
                  dtype: torch.dtype | None = None, tokenizer: str | None = None,
                  base: BaseReader | None = None) -> dict:
    """Write a PEFT adapter directory at ``out``. adapters: {unit: its adapters' flat buffer [numel]}
    (:class:`~megatrain_ray.model.lora.AdapterLayout`); full: {HF name: tensor} of the base tensors
    trained in full (:func:`full_names`); base_model: the base's directory or hub id, for
    adapter_config.json; dtype: of the written tensors (None: as given); tokenizer: the run's, whose
    chat template's end of turn joins the base's generation_config.json written beside the adapters
    (:func:`~megatrain_ray.io.generation.write_generation_config`: PEFT loads the base's, so
    ``generate`` stops at the end of a turn with ``generation_config=GenerationConfig.from_pretrained``
    of this directory); base: reads the frozen base tensors saved beside a router trained in full
    (:func:`router_companions`; needed only where there are some). Returns a summary."""
    layout = AdapterLayout.build(cfg, lora)
    tensors = []
    for unit, template in zip(layout.units, layout.templates):
        for key, t in peft_tensors(cfg, lora, unit, template.bind(adapters[unit])):
            tensors.append(TensorSource.of(key, t.contiguous() if dtype is None else t.to(dtype).contiguous()))
    for key, name in _full_keys(cfg, lora):
        tensors.append(TensorSource.of(key, full[name] if dtype is None else full[name].to(dtype)))
    for key, unit, name in router_companions(cfg, lora):
        tensors.append(TensorSource.of(key, base(unit, name).contiguous()))  # kept as stored: frozen
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
            if name in p:  # a base weight trained in full beside the adapters (a router)
                return p[name].to(dtype)
            expert = expert_merged_weight(cfg, layout, p, name, weight.float()) if p else None
            if expert is not None:
                return expert.to(dtype)
            module = name.removesuffix(".weight")
            if f"{module}.lora_A.weight" not in p:
                return weight.to(dtype)
            return merged_weight(weight.float(), p[f"{module}.lora_A.weight"], p[f"{module}.lora_B.weight"],
                                 layout.scaling).to(dtype)
        return load

    tensors = hub_form(cfg, [TensorSource(hf_name(unit, name), tuple(shape), dtype, reader(unit, name))
                             for unit in unit_names(cfg) for name, shape in unit_params(cfg, unit)])
    return write_model_dir(out, "the merged weights", cfg, dtype, tensors, shard_bytes, source, tokenizer)
