"""The lora section: low-rank adapters on a frozen base, as PEFT's ``LoraConfig`` describes them.

With ``lora.rank`` > 0 the base model's weights are frozen and each targeted linear layer of every
decoder layer gains an adapter, y = W x + b + scaling * B (A x), A: [rank, in], B: [out, rank],
scaling = alpha / rank (alpha / sqrt(rank) with ``use_rslora``); only the adapters (and, if asked,
the embedding, the LM head and the routers in full) are trained. Names, initialisation and scaling
are PEFT's, so a run's adapters load with ``peft.PeftModel.from_pretrained`` (see megatrain_ray.io.peft_io).

In a sparse (mixture-of-experts) layer the attention's and the shared expert's projections get
adapters as a dense layer's do (``target_modules``), and the routed experts' fused parameters get
PEFT's adapters on parameters (``target_experts``, PEFT's ``target_parameters``): per expert e,
W_e + scaling * B_e A_e, one rank-r pair per expert. The router stays frozen unless
``train_router``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .fields import require as _require

BASE_FORMATS = ("compute", "int8", "nf4", "mxfp4")
"""lora.base_format's values (megatrain_ray.model.quant_layout)."""
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers an adapter may target, by their Hugging Face module names."""

EXPERT_TARGETS = ("gate_up_proj", "down_proj")
"""The routed experts' fused parameters an adapter may target, by their names under transformers'
experts module (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I])."""


PEFT_FUSED_MOE = ("qwen3_moe", "mixtral", "glm4_moe")
"""Model types whose MLP projection names (gate_proj, up_proj, down_proj; Mixtral's w1, w3, w2) PEFT
maps to the routed experts' fused parameters when it builds or loads adapters on transformers 5's
model (``peft.utils.transformers_weight_conversion``), so that a dense MLP layer of such a model
cannot carry an adapter PEFT loads."""


MX_BLOCK = 32
"""Elements of an MXFP4 block along a weight's row (megatrain_ray.model.mxfp4)."""


def mxfp4_refusal(model) -> str | None:
    """Why lora.base_format mxfp4 does not fit ``model`` (a ModelConfig), as the end of a sentence that
    names the key, or None where it fits: a mixture of experts whose routed experts' input widths
    (model.hidden_size for gate and up, the expert width for down) are multiples of :data:`MX_BLOCK`."""
    if not model.sparse_layers:
        return (f"mxfp4 quantizes the routed experts of a mixture of experts, and a {model.model_type} model "
                "without sparse layers has none; choose nf4 or int8 to quantize its projections")
    width = "model.moe_intermediate_size" if model.moe_intermediate_size else "model.intermediate_size"
    odd = [f"{k} ({v})" for k, v in (("model.hidden_size", model.hidden_size), (width, model.expert_size))
           if v % MX_BLOCK]
    if odd:
        return (f"mxfp4 quantizes each routed expert's rows in blocks of {MX_BLOCK}, but {' and '.join(odd)} "
                f"{'is' if len(odd) == 1 else 'are'} not a multiple of {MX_BLOCK}; choose nf4 or int8")
    return None


@dataclass(frozen=True)
class LoraSection:
    """Low-rank adapters (LoRA) on a frozen base; rank 0 trains the whole model instead."""

    rank: int = 0
    """Rank r of every adapter (PEFT's ``r``); 0: no adapters, every parameter is trained."""
    alpha: float = 8.0
    """PEFT's ``lora_alpha``: the adapter's output is scaled by alpha / rank (alpha / sqrt(rank) with
    use_rslora)."""
    use_rslora: bool = False
    """Rank-stabilised scaling, alpha / sqrt(rank), as PEFT's ``use_rslora``."""
    dropout: float = 0.0
    """PEFT's ``lora_dropout``: the probability that an element of an adapter's input is zeroed during
    training (the rest scaled by 1 / (1 - p)), in [0, 1). Each mask is a function of train.seed, the
    step, the micro-batch and the projection, so the backward's recompute and a resumed run draw
    the same one (megatrain_ray.model.lora)."""
    target_modules: tuple[str, ...] = LORA_TARGETS
    """The linear layers of each decoder layer that get an adapter, by Hugging Face name (any of
    q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), as a list or comma-separated."""
    target_experts: tuple[str, ...] = EXPERT_TARGETS
    """The routed experts' fused parameters of each sparse layer that get an adapter per expert
    (PEFT's ``target_parameters``: ``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``), by
    their names (gate_up_proj, down_proj), as a list or comma-separated; [] for none. Ignored by a
    dense model. The shared expert (Qwen2-MoE) is a set of linear layers, targeted by target_modules."""
    train_router: bool = False
    """Also train each sparse layer's router in full (PEFT's ``modules_to_save: [mlp.gate]``); by
    default it stays frozen, so the routing moves only through the adapters upstream of it. Not on
    gpt_oss (PEFT would train its router's bias with the weight)."""
    train_embedding: bool = False
    """Also train the token embedding in full (PEFT's ``modules_to_save: [embed_tokens]``)."""
    train_head: bool = False
    """Also train the LM head in full (PEFT's ``modules_to_save: [lm_head]``); the final norm stays frozen."""

    base_format: str = "compute"
    """How the frozen base is stored in host memory and streamed: ``compute`` (the compute dtype, bf16 on
    CUDA: 2 bytes per parameter), ``int8`` (LLM.int8()'s row-wise int8 with an fp32 absmax per row,
    ~1 byte) or ``nf4`` (QLoRA's 4-bit NormalFloat, blocks of 64 with double-quantized absmax, ~0.52
    byte), each as bitsandbytes stores it, which quantize the decoder layers' projection matrices;
    or ``mxfp4`` (OCP Microscaling FP4: 4-bit e2m1 codes, an e8m0 scale per 32 along each row, 0.53
    byte), which quantizes the routed experts' weights alone, as gpt-oss's Hub checkpoints hold them
    (whose blocks and scales are then read as they are): a mixture of experts only, whose routed
    experts' input widths (model.hidden_size, the expert width) are multiples of 32; a dense model
    takes nf4 or int8. The quantized matrices are quantized once as the base is loaded, held and
    streamed quantized, and dequantized on the device into the compute dtype before each layer's
    pass (nf4, int8: bit for bit as bitsandbytes dequantizes them; mxfp4: as transformers does);
    the rest (norms, biases, routers, the embedding and the LM head; with mxfp4 the attention and
    the shared experts too) stays in the compute dtype (megatrain_ray.model.quant, .mxfp4)."""

    @property
    def quantized(self) -> bool:
        """Whether the base is stored quantized (lora.base_format int8, nf4 or mxfp4)."""
        return self.enabled and self.base_format != "compute"

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """The factor of the adapter's output (PEFT's ``scaling``); 0 without adapters."""
        if not self.enabled:
            return 0.0
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def modules_to_save(self) -> tuple[str, ...]:
        """The base modules trained in full, by PEFT's names."""
        return ((("embed_tokens",) if self.train_embedding else ()) + (("lm_head",) if self.train_head else ())
                + (("mlp.gate",) if self.train_router else ()))

    def validate(self) -> None:
        _require(self.rank >= 0, "lora.rank", f"must be >= 0 (0 = no adapters), got {self.rank}")
        _require(math.isfinite(self.alpha) and self.alpha > 0, "lora.alpha", f"must be positive, got {self.alpha}")
        _require(0.0 <= self.dropout < 1.0, "lora.dropout", f"must be in [0, 1), got {self.dropout}")
        targets = self.target_modules
        _require(len(targets) > 0, "lora.target_modules", f"must name at least one of {', '.join(LORA_TARGETS)}")
        unknown = [t for t in targets if t not in LORA_TARGETS]
        _require(not unknown, "lora.target_modules",
                 f"names {', '.join(map(repr, unknown))}, which is not a linear layer of a decoder layer; "
                 f"use any of {', '.join(LORA_TARGETS)}")
        _require(len(set(targets)) == len(targets), "lora.target_modules", f"names a module twice: {list(targets)}")
        _require(self.base_format in BASE_FORMATS, "lora.base_format",
                 f"must be one of {', '.join(BASE_FORMATS)}, got {self.base_format!r}")
        experts = self.target_experts
        unknown = [t for t in experts if t not in EXPERT_TARGETS]
        _require(not unknown, "lora.target_experts",
                 f"names {', '.join(map(repr, unknown))}, which is not a fused parameter of the routed experts; "
                 f"use any of {', '.join(EXPERT_TARGETS)} (or [] for none)")
        _require(len(set(experts)) == len(experts), "lora.target_experts", f"names a parameter twice: {list(experts)}")
        if not self.enabled:
            _require(self.base_format == "compute", "lora.base_format",
                     "needs lora.rank > 0 (a base trained in full is stored unquantized)")
            trained = [k for k, v in (("train_embedding", self.train_embedding), ("train_head", self.train_head),
                                      ("train_router", self.train_router)) if v]
            _require(not trained, f"lora.{trained[0] if trained else ''}",
                     "needs lora.rank > 0 (without adapters every parameter is trained)")
