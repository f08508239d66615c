"""Low-rank adapters (LoRA) beside the model's projections: which exist, their names and shapes, PEFT's
initialisation, binding them next to a unit's base weights, and merging them into those weights.

An adapter of the projection ``self_attn.q_proj`` of ``layers.i`` is two matrices named as PEFT names
them, relative to the unit: ``self_attn.q_proj.lora_A.weight`` A: [r, in] and
``self_attn.q_proj.lora_B.weight`` B: [out, r]; the layer then computes W x + b + scaling * B (A x)
(:func:`megatrain_ray.model.transformer.linear`). A decoder layer's adapters form an *adapter unit*
of their own, laid out like any unit (:class:`~megatrain_ray.model.layout.LayerTemplate`), so one
flat buffer holds them and one optimizer call updates them. The embedding and the head carry no
adapters; lora.train_embedding / train_head train their matrix in full instead (PEFT's
``modules_to_save``): :attr:`AdapterLayout.full`, one template per trained matrix, by its name in
its unit (the head's final norm stays frozen).

A sparse layer's (mixture of experts) adapters: its attention's and its shared expert's projections
as above, and for each targeted stacked parameter of its routed experts (lora.target_experts,
PEFT's ``target_parameters``) one adapter per expert, held stacked: ``mlp.experts.gate_up_proj.lora_A.weight``
[E, r, H] and ``...lora_B.weight`` [E, 2I, r] (down_proj: [E, r, I], [E, H, r]; Mixtral's under
``block_sparse_moe``), which :func:`~megatrain_ray.model.moe.routed_experts` adds per expert inside
its grouped GEMMs. PEFT holds the same numbers as one [E * r, in] A (our A, reshaped) and one
[out, r * E] B (our B permuted, rank-major); :mod:`megatrain_ray.io.peft_io` converts. With
lora.train_router each sparse layer's router is trained in full beside its adapters (its tensor in
the adapter unit, bound over the frozen one).

Dropout (lora.dropout > 0) is PEFT's ``lora_dropout``: during training each adapter reads its
projection's input with a fraction p of the elements zeroed and the rest scaled by 1 / (1 - p). The
mask (:func:`dropout_masks`) is a pure function of the run's seed, the step, the micro-batch and the
projection's full name, drawn from its own generator, so the recompute of the backward, a kept
graph and a resumed run all see the same one, and no random state needs saving.

Initialisation is PEFT's default (``init_lora_weights=True``): A Kaiming-uniform with a = sqrt(5)
(uniform in +-1/sqrt(in)), B zero, so a fresh adapter leaves the model's output unchanged. Each
matrix draws from its own generator, seeded by a CRC-32 of the run's seed and the matrix's full name
(the CPU generator keeps 32 bits of a seed), so the values depend on neither the order of creation
nor the other adapters.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from ..config import EXPERT_TARGETS, LoraSection, ModelConfig
from . import moe
from .layout import LayerTemplate, built_once
from .transformer import Params, hf_name, unit_names, unit_params

PEFT_PREFIX = "base_model.model."
"""What PEFT's saved adapter keys put before the base model's own names."""


def projection_name(param: str) -> str | None:
    """``self_attn.q_proj.weight`` or a shared expert's ``mlp.shared_expert.gate_proj.weight`` (GLM's
    ``mlp.shared_experts.gate_proj.weight``) -> ``q_proj``,
    ``gate_proj`` (the HF module name lora.target_modules uses); None for a parameter that is no such
    projection's weight (norms, biases, a router, a routed expert's weights)."""
    parts = param.split(".")
    if parts[-1] != "weight" or not parts[-2].endswith("_proj"):
        return None
    return parts[-2] if len(parts) == 3 or (len(parts) == 4 and ".".join(parts[:2]) in moe.SHARED_MODULES) else None


def expert_modules(cfg: ModelConfig, lora: LoraSection) -> list[tuple[str, str, tuple[int, int]]]:
    """(target name of :data:`~megatrain_ray.config.EXPERT_TARGETS`, the stacked parameter's name in a
    sparse layer, (out, in) of one expert's matrix) of each routed-expert parameter lora targets, in
    EXPERT_TARGETS' order (gate_up_proj [2I, H], then down_proj [H, I])."""
    h, i = cfg.hidden_size, cfg.expert_size
    stacked = dict(zip(EXPERT_TARGETS, moe.names(cfg).stacked))
    shapes = {"gate_up_proj": (2 * i, h), "down_proj": (h, i)}
    return [(t, stacked[t], shapes[t]) for t in EXPERT_TARGETS if t in lora.target_experts]


def adapter_params(cfg: ModelConfig, lora: LoraSection, unit: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name relative to the unit, shape) of each adapter matrix of ``unit``, in the order of its
    projections: A [r, in] then B [out, r] of each targeted one (attention's, the dense MLP's or the
    shared expert's); in a sparse layer then A [E, r, in] and B [E, out, r] of each targeted stacked
    expert parameter (:func:`expert_modules`), and its router [E, H] with lora.train_router; none for
    the embedding and the head."""
    if not lora.enabled or not unit.startswith("layers."):
        return []
    out = []
    for name, (rows, cols) in ((n, s) for n, s in unit_params(cfg, unit) if projection_name(n) in lora.target_modules):
        module = name.removesuffix(".weight")
        out += [(f"{module}.lora_A.weight", (lora.rank, cols)), (f"{module}.lora_B.weight", (rows, lora.rank))]
    if cfg.is_sparse(int(unit.split(".")[1])):
        e = cfg.num_experts
        for _, module, (rows, cols) in expert_modules(cfg, lora):
            out += [(f"{module}.lora_A.weight", (e, lora.rank, cols)), (f"{module}.lora_B.weight", (e, rows, lora.rank))]
        if lora.train_router:
            out.append((moe.names(cfg).router, (e, cfg.hidden_size)))
    return out


def is_adapter(name: str) -> bool:
    """Whether a tensor of an adapter unit is an adapter matrix (``...lora_A.weight``), not a base
    weight trained in full beside the adapters (a router under lora.train_router), which starts
    from the base's value."""
    return ".lora_" in name


@dataclass(frozen=True)
class AdapterLayout:
    """The adapter units of a model: for each decoder layer, the flat layout of its adapters."""

    units: tuple[str, ...]
    """The units that carry adapters (``layers.i``), in forward order."""
    templates: tuple[LayerTemplate, ...]
    scaling: float
    """The factor of every adapter's output (:attr:`~megatrain_ray.config.LoraSection.scaling`)."""
    full: tuple[LayerTemplate, ...] = ()
    """The base matrices trained in full (lora.train_embedding: the embedding's ``weight``; lora.train_head:
    the head's ``lm_head.weight``), each a template of that one tensor, named by its unit."""

    @classmethod
    def build(cls, cfg: ModelConfig, lora: LoraSection) -> "AdapterLayout":
        """The adapters of ``cfg`` as ``lora`` sets them (built once per config,
        :func:`~megatrain_ray.model.layout.built_once`)."""
        return built_once(("adapters", repr(cfg), repr(lora)), lambda: cls._build(cfg, lora))

    @classmethod
    def _build(cls, cfg: ModelConfig, lora: LoraSection) -> "AdapterLayout":
        units = tuple(u for u in unit_names(cfg) if adapter_params(cfg, lora, u))
        shape = (cfg.vocab_size, cfg.hidden_size)
        full = (((LayerTemplate.of("embed", [("weight", shape)]),) if lora.enabled and lora.train_embedding else ())
                + ((LayerTemplate.of("head", [("lm_head.weight", shape)]),) if lora.enabled and lora.train_head
                   else ()))
        return cls(units, tuple(LayerTemplate.of(u, adapter_params(cfg, lora, u)) for u in units), lora.scaling, full)

    @property
    def trained(self) -> tuple[tuple[str, LayerTemplate], ...]:
        """(unit, template) of everything a LoRA run trains and checkpoints: each layer's adapters,
        then the matrices trained in full."""
        return (*zip(self.units, self.templates), *((t.unit, t) for t in self.full))

    def template(self, unit: str) -> LayerTemplate | None:
        """``unit``'s adapter template, or None when it has no adapters."""
        return self.templates[self.units.index(unit)] if unit in self.units else None

    @property
    def num_params(self) -> int:
        return sum(t.param_count for t in self.templates)

    def active_params(self, cfg: ModelConfig) -> int:
        """The adapter parameters a token goes through: :attr:`num_params` with the routed experts'
        adapters of each sparse layer counted for the k experts a token is routed to, not all E."""
        total = 0
        for template in self.templates:
            for name, shape, _ in template.params:
                n = math.prod(shape)
                total += n * cfg.num_experts_per_tok // cfg.num_experts if len(shape) == 3 else n
        return total

    def init(self, unit: str, seed: int) -> torch.Tensor:
        """``unit``'s adapters as PEFT initialises them (see the module docstring): [numel] fp32; a base
        weight trained in full beside them (:func:`is_adapter` false) is zero here, its value the
        base's, which the caller copies in."""
        template = self.template(unit)
        flat = torch.zeros(template.numel, dtype=torch.float32)
        for name, t in template.bind(flat).items():
            if ".lora_A." in name:  # [r, in], or the experts' [E, r, in] as PEFT's one [E * r, in] matrix
                g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{hf_name(unit, name)}".encode()))
                torch.nn.init.kaiming_uniform_(t.view(-1, t.shape[-1]), a=math.sqrt(5), generator=g)
        return flat

    def bind(self, unit: str, flat: torch.Tensor) -> Params:
        """flat: [>= numel] holding ``unit``'s adapters -> their views, with each projection's
        ``lora_scaling``, to be offered to the model beside the unit's base weights (``{**base,
        **adapters}``). The scaling is a 0-d fp32 CPU tensor: torch reads such a tensor as a scalar
        at full precision whatever the other operand's dtype and device (as PEFT's Python float)."""
        views = self.template(unit).bind(flat)
        scale = torch.tensor(self.scaling, dtype=torch.float32)
        return {**views, **{n.replace(".lora_A.weight", ".lora_scaling"): scale for n in views if ".lora_A." in n}}


def dropout_keep(unit: str, module: str, seed: int, step: int, micro_batch: int, shape: tuple[int, ...], p: float,
                 device) -> torch.Tensor:
    """Which elements of the input [B, S, in] of ``unit``'s projection ``module`` (``self_attn.q_proj``)
    an adapter keeps in micro-batch ``micro_batch`` of step ``step`` under dropout ``p``: a bool
    tensor drawn from a generator seeded by a CRC-32 of all of them (see the module docstring)."""
    g = torch.Generator(device=device).manual_seed(
        zlib.crc32(f"{seed}:{step}:{micro_batch}:{hf_name(unit, module)}".encode()))
    return torch.rand(shape, generator=g, device=device) >= p


def dropout_masks(layout: AdapterLayout, unit: str, p: float, seed: int, step: int, micro_batch: int,
                  rows: tuple[int, int], device, dtype: torch.dtype) -> Params:
    """``{module}.lora_dropout`` of each of ``unit``'s adapters for one micro-batch of ``rows`` (B, S)
    tokens: [B, S, in] in ``dtype``, 0 where dropped, 1 / (1 - p) where kept; {} for p = 0 or a unit
    without adapters."""
    template = layout.template(unit)
    if not p or template is None:
        return {}
    out = {}
    for name, (_, cols), _ in (e for e in template.params if ".lora_A." in e[0]):
        module = name.removesuffix(".lora_A.weight")
        keep = dropout_keep(unit, module, seed, step, micro_batch, (*rows, cols), p, device)
        out[f"{module}.lora_dropout"] = keep.to(dtype) / (1 - p)
    return out


def peft_name(unit: str, name: str) -> str:
    """The key of a unit's tensor (an adapter matrix, or a base weight trained in full) in PEFT's
    adapter_model.safetensors: ``base_model.model.`` + its full HF name."""
    return PEFT_PREFIX + hf_name(unit, name)


def expert_merged_weight(cfg: ModelConfig, layout: AdapterLayout, views: Params, name: str,
                         weight: torch.Tensor) -> torch.Tensor | None:
    """A routed expert's Hub tensor ``name`` (``mlp.experts.3.up_proj.weight``, Mixtral's ``w3``) of a
    sparse layer with its expert's adapter merged in, from the layer's adapter ``views``: gate and up take
    their rows of the gate_up_proj delta, down the down_proj delta (:func:`merged_weight`); None where
    that parameter has no adapter. weight: the base's [out, in]."""
    kind, e = moe.part_of(name)
    if kind != moe.EXPERT:
        return None
    gate, up, down = moe.names(cfg).expert(e)
    if name not in (gate, up, down):  # a biased family's (gpt-oss's) expert bias: no adapter
        return None
    gate_up_name, down_name = moe.names(cfg).stacked
    module, rows = ((down_name, slice(None)) if name == down else
                    (gate_up_name, slice(0, cfg.expert_size) if name == gate else slice(cfg.expert_size, None)))
    a = views.get(f"{module}.lora_A.weight")
    if a is None:
        return None
    return merged_weight(weight, a[e], views[f"{module}.lora_B.weight"][e][rows], layout.scaling)


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """weight: [out, in] + scaling * b [out, r] @ a [r, in], computed in fp32 and rounded once to
    weight's dtype (PEFT's ``merge_and_unload`` adds the same delta)."""
    return (weight.float() + (b.float() @ a.float()) * scaling).to(weight.dtype)
