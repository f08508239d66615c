"""The model section: a decoder-only transformer's shape (Llama / Qwen2 / Qwen3 / Mistral, and the
mixtures of experts Qwen3-MoE / Mixtral / Qwen2-MoE / GLM-4.5 / gpt-oss), named as in Hugging Face
config.json, and its mapping to and from such a config.json (the families and their own fields'
checks: :mod:`megatrain_ray.config.families`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .fields import require as _require
from .fields import section_from_dict
from .families import (ARCHITECTURES, GLM_FIELDS, GLM_HF_DEFAULTS, GPT_OSS_FIELDS, LAYER_TYPES, MOE_FIELDS,
                       MOE_MODEL_TYPES, SUPPORTED_MODEL_TYPES, validate_glm, validate_gpt_oss, validate_rope_scaling)


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer shape (Llama / Qwen2 / Qwen3 / Mistral / Qwen3-MoE / Mixtral /
    Qwen2-MoE / GLM-4.5 / gpt-oss), named as in HF config.json."""

    model_type: str = "llama"
    """Architecture family: one of llama, qwen2, qwen3, mistral, qwen3_moe, mixtral, qwen2_moe, glm4_moe,
    gpt_oss (qwen2 and qwen2_moe add q/k/v biases, qwen3 and qwen3_moe q/k norms; the *_moe ones,
    mixtral and gpt_oss replace the MLP of their sparse layers by a mixture of experts; glm4_moe's
    router is sigmoid-scored with a score-correction bias and expert groups, see
    megatrain_ray.model.moe; gpt_oss adds biases to every projection, router and expert, a learned
    attention sink per head, and alternates sliding-window and full attention by layer_types)."""
    vocab_size: int = 260
    """Number of token embeddings (rows of the embedding and LM-head matrices)."""
    hidden_size: int = 64
    """Width of the residual stream."""
    intermediate_size: int = 176
    """Width of the SwiGLU MLP's gate/up projections (of a dense layer; for mixtral, of each expert)."""
    num_hidden_layers: int = 2
    """Number of decoder layers."""
    num_attention_heads: int = 4
    """Number of query heads."""
    num_key_value_heads: int | None = None
    """Number of key/value heads (grouped-query attention); None means equal to num_attention_heads."""
    head_dim: int | None = None
    """Per-head width; None means hidden_size // num_attention_heads."""
    rms_norm_eps: float = 1e-6
    """Epsilon inside every RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    rope_scaling: dict[str, float | int | str] | None = None
    """RoPE frequency scaling, as HF config.json's rope_scaling: None for plain RoPE, Llama 3.1's
    {rope_type: llama3, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings},
    or YaRN's {rope_type: yarn, factor, original_max_position_embeddings, beta_fast, beta_slow,
    truncate, attention_factor} (gpt-oss; see model.rope_cache); other rope types are refused."""
    max_position_embeddings: int = 2048
    """Longest sequence the model is configured for; train.seq_len may not exceed it."""
    tie_word_embeddings: bool = False
    """If true the LM head reuses the embedding matrix."""
    attention_bias: bool | None = None
    """q/k/v projections carry a bias; None means the family default (true for qwen2, qwen2_moe and
    gpt_oss, else false). With it, llama, qwen3, qwen3_moe and gpt_oss also give o_proj a bias."""
    initializer_range: float = 0.02
    """Standard deviation of the normal initialisation of matrices when not loading weights."""
    sliding_window: int | None = None
    """Sliding-window attention span: a query sees itself and the sliding_window - 1 positions before
    it. Applied on the layers layer_types marks sliding_attention (gpt_oss); for the other families
    (Mistral v0.1) attention here is full causal, so train.seq_len may not exceed it. None: no window."""
    layer_types: list[str] | None = None
    """Each decoder layer's attention (gpt_oss): "sliding_attention" (limited to sliding_window) or
    "full_attention", as HF config.json's layer_types; None means gpt-oss's default, sliding on
    even layers (0, 2, ...) and full on odd ones; other families have none (every layer full)."""
    swiglu_alpha: float | None = None
    """gpt_oss's experts' activation: glu = gate * sigmoid(swiglu_alpha * gate); None: gpt-oss's 1.702
    for gpt_oss, and the plain SwiGLU (silu(gate) * up) for the other families."""
    swiglu_limit: float | None = None
    """gpt_oss's experts' clamp before that activation: gate to at most swiglu_limit, up to
    [-swiglu_limit, swiglu_limit], the output (up + 1) * glu; None: gpt-oss's 7.0 for gpt_oss (other
    families: no clamp)."""

    num_experts: int = 0
    """Routed experts of each sparse layer (HF: num_experts for qwen3_moe / qwen2_moe, num_local_experts
    for mixtral and gpt_oss, n_routed_experts for glm4_moe); 0 for a dense family."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k of the router's softmax, or of glm4_moe's biased sigmoid
    scores); 0 for a dense family."""
    moe_intermediate_size: int | None = None
    """Width of each routed expert's SwiGLU gate/up projections; None means intermediate_size (mixtral,
    whose config.json has no such key)."""
    norm_topk_prob: bool | None = None
    """Renormalise the top-k routing weights to sum to 1; None means the family default (true for
    mixtral and gpt_oss, which always do, false for qwen3_moe and qwen2_moe, as transformers' configs;
    a glm4_moe config.json without the key: true, as transformers' Glm4MoeConfig)."""
    decoder_sparse_step: int = 1
    """Layer i is sparse (a mixture of experts) when (i + 1) is a multiple of this and i is not in
    mlp_only_layers; the others have a dense MLP of intermediate_size (qwen3_moe, qwen2_moe)."""
    mlp_only_layers: list[int] = dataclasses.field(default_factory=list)
    """Layer indices that keep a dense MLP whatever decoder_sparse_step says (qwen3_moe, qwen2_moe)."""
    shared_expert_intermediate_size: int = 0
    """Width of the shared expert every token goes through beside the routed ones, scaled by a sigmoid
    gate (qwen2_moe); 0: none."""
    router_aux_loss_coef: float = 0.001
    """Weight of the router's load-balancing auxiliary loss in the training loss (only with
    output_router_logits, as transformers adds it)."""
    output_router_logits: bool = False
    """Add router_aux_loss_coef x the load-balancing loss (Switch Transformer's, over all sparse layers
    of a micro-batch, as transformers' load_balancing_loss_func given the attention mask: the padding
    of padded rows is left out of it) to the training loss, as transformers does when this is on;
    off: the loss is the cross-entropy alone (the routing is still trained through the routing
    weights). glm4_moe has no such loss (transformers computes none for it): refused there."""

    n_shared_experts: int = 0
    """glm4_moe: shared experts every token goes through beside the routed ones, ungated, held as one
    SwiGLU MLP of width n_shared_experts x moe_intermediate_size (``mlp.shared_experts``); 0: none."""
    first_k_dense_replace: int = 0
    """glm4_moe: the first this many layers keep a dense MLP of intermediate_size; the rest are sparse."""
    n_group: int = 1
    """glm4_moe: the routed experts fall into this many equal groups (consecutive expert indices); a
    token's experts come from its topk_group best groups (each scored by the sum of its two best
    biased scores). 1: no grouping."""
    topk_group: int = 1
    """glm4_moe: how many of the n_group groups a token's top-k experts are chosen from."""
    routed_scaling_factor: float = 1.0
    """glm4_moe: the factor of the routing weights (after their renormalisation, with norm_topk_prob)."""
    use_qk_norm: bool = False
    """glm4_moe: RMS-normalise queries and keys per head before RoPE (qwen3 and qwen3_moe always do)."""
    partial_rotary_factor: float | None = None
    """glm4_moe: the fraction of each head's dims that RoPE rotates (the first head_dim x this; the rest
    pass through unrotated); None means the family default (0.5 for glm4_moe, as transformers'
    Glm4MoeConfig; 1.0, all of them, for the others, where it may not be set). transformers 5 keeps it
    in config.json's rope_parameters, 4 at the top level: both are read, both written."""
    num_nextn_predict_layers: int = 0
    """glm4_moe: the multi-token-prediction layers the Hub's checkpoints hold after the last decoder
    layer (``model.layers.{num_hidden_layers}.*``). Not part of the causal LM (transformers' model has
    none): their tensors are skipped on import, and the number is written back to config.json."""

    def __post_init__(self) -> None:
        """Fill the fields whose None means "the family's default" (part of construction: the
        dataclass is frozen, so they are set through ``object.__setattr__``, once)."""
        for key, value in self._defaults().items():
            object.__setattr__(self, key, value)

    def _defaults(self) -> dict[str, Any]:
        """The values of the fields left None that the family decides (num_key_value_heads,
        attention_bias, norm_topk_prob, partial_rotary_factor; gpt_oss's layer_types and swiglu_*)."""
        glm = self.model_type == "glm4_moe"
        family = {"num_key_value_heads": self.num_attention_heads,
                  "attention_bias": self.model_type in ("qwen2", "qwen2_moe", "gpt_oss"),
                  "norm_topk_prob": self.model_type in ("mixtral", "gpt_oss"),
                  "partial_rotary_factor": GLM_HF_DEFAULTS["partial_rotary_factor"] if glm else 1.0}
        if self.model_type == "gpt_oss":
            family.update(layer_types=[LAYER_TYPES[(i + 1) % 2] for i in range(self.num_hidden_layers)],
                          swiglu_alpha=1.702, swiglu_limit=7.0)
        return {key: value for key, value in family.items() if getattr(self, key) is None}

    @property
    def head_size(self) -> int:
        """Per-head width actually used (head_dim, or hidden_size / heads)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def o_proj_bias(self) -> bool:
        """Whether the attention output projection has a bias (HF Llama/Qwen3 with attention_bias)."""
        return bool(self.attention_bias) and self.model_type in ("llama", "qwen3", "qwen3_moe", "gpt_oss")

    @property
    def attention_sinks(self) -> bool:
        """Whether each attention head has a learned sink logit (``self_attn.sinks`` [heads], gpt-oss)."""
        return self.model_type == "gpt_oss"

    def window(self, layer: int) -> int | None:
        """The sliding window decoder layer ``layer`` applies (layer_types says sliding_attention), else None."""
        if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def qk_norm(self) -> bool:
        """Whether queries and keys are RMS-normalised per head before RoPE (Qwen3, Qwen3-MoE, and
        GLM-4.5 with use_qk_norm)."""
        return self.model_type in ("qwen3", "qwen3_moe") or self.use_qk_norm

    @property
    def rotary_dim(self) -> int:
        """How many of each head's first dims RoPE rotates: head_size x partial_rotary_factor."""
        return int(self.head_size * self.partial_rotary_factor)

    @property
    def router_scoring(self) -> str:
        """``softmax`` (top-k of the router's softmax) or ``sigmoid`` (GLM-4.5's: sigmoid scores, a
        score-correction bias for the choice, expert groups); megatrain_ray.model.moe routes by it."""
        return "sigmoid" if self.model_type == "glm4_moe" else "softmax"

    @property
    def shared_expert_size(self) -> int:
        """Width of the shared expert (Qwen2-MoE's shared_expert_intermediate_size, GLM's n_shared_experts
        x moe_intermediate_size); 0: none."""
        return self.shared_expert_intermediate_size or self.n_shared_experts * self.expert_size

    @property
    def is_moe(self) -> bool:
        """Whether this is a mixture-of-experts family (some layers sparse)."""
        return self.model_type in MOE_MODEL_TYPES

    @property
    def expert_size(self) -> int:
        """Width of each routed expert's gate/up projections."""
        return self.moe_intermediate_size or self.intermediate_size

    def beyond_layers(self, name: str) -> bool:
        """Whether the HF tensor ``name`` belongs to a multi-token-prediction layer after the last
        decoder layer (``model.layers.{num_hidden_layers + j}.*``, j < num_nextn_predict_layers)."""
        parts = name.split(".")
        return (len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
                and 0 <= int(parts[2]) - self.num_hidden_layers < self.num_nextn_predict_layers)

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a mixture of experts (else a dense MLP), as transformers
        decides it: not in mlp_only_layers, experts present, (layer + 1) % decoder_sparse_step == 0, and
        not among the first first_k_dense_replace (glm4_moe)."""
        return (self.is_moe and self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0 and layer >= self.first_k_dense_replace)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The indices of the sparse (mixture-of-experts) layers."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_sparse(i))

    def validate(self) -> None:
        _require(self.model_type in SUPPORTED_MODEL_TYPES, "model.model_type",
                 f"must be one of {', '.join(SUPPORTED_MODEL_TYPES)}, got {self.model_type!r}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            _require(getattr(self, key) > 0, f"model.{key}", f"must be positive, got {getattr(self, key)}")
        _require(self.head_dim is not None or self.hidden_size % self.num_attention_heads == 0,
                 "model.num_attention_heads",
                 f"must divide model.hidden_size ({self.hidden_size}), got {self.num_attention_heads}")
        _require(self.head_dim is None or self.head_dim > 0, "model.head_dim",
                 f"must be positive, got {self.head_dim}")
        _require(self.head_size % 2 == 0, "model.head_dim", f"must be even for RoPE, got {self.head_size}")
        _require(self.sliding_window is None or self.sliding_window > 0, "model.sliding_window",
                 f"must be positive, got {self.sliding_window}")
        _require(self.num_attention_heads % self.num_key_value_heads == 0, "model.num_key_value_heads",
                 f"must divide model.num_attention_heads ({self.num_attention_heads}), "
                 f"got {self.num_key_value_heads}")
        _require(self.rms_norm_eps > 0, "model.rms_norm_eps", f"must be positive, got {self.rms_norm_eps}")
        _require(self.rope_theta > 0, "model.rope_theta", f"must be positive, got {self.rope_theta}")
        if self.rope_scaling is not None:
            validate_rope_scaling(self.rope_scaling)
        _require(self.initializer_range > 0, "model.initializer_range",
                 f"must be positive, got {self.initializer_range}")
        if self.model_type != "glm4_moe":
            for key in GLM_FIELDS:
                _require(getattr(self, key) == getattr(ModelConfig(), key), f"model.{key}",
                         f"is a glm4_moe setting, which a {self.model_type} model does not have; remove it")
        if self.model_type == "gpt_oss":
            validate_gpt_oss(self)
        else:
            for key in GPT_OSS_FIELDS:
                _require(getattr(self, key) is None, f"model.{key}",
                         f"is a gpt_oss setting, which a {self.model_type} model does not have; remove it")
        if self.is_moe:
            self._validate_moe()
        else:
            dense = ModelConfig()
            for key in MOE_FIELDS:
                _require(getattr(self, key) in (getattr(dense, key), None), f"model.{key}",
                         f"is a mixture-of-experts setting, which a {self.model_type} model does not have; remove "
                         f"it, or use one of {', '.join(MOE_MODEL_TYPES)}")

    def _validate_moe(self) -> None:
        _require(self.num_experts > 0, "model.num_experts",
                 f"must be positive for a {self.model_type} model, got {self.num_experts}")
        _require(0 < self.num_experts_per_tok <= self.num_experts, "model.num_experts_per_tok",
                 f"must be between 1 and model.num_experts ({self.num_experts}), got {self.num_experts_per_tok}")
        _require(self.moe_intermediate_size is None or self.moe_intermediate_size > 0, "model.moe_intermediate_size",
                 f"must be positive, got {self.moe_intermediate_size}")
        _require(self.decoder_sparse_step > 0, "model.decoder_sparse_step",
                 f"must be positive, got {self.decoder_sparse_step}")
        _require(isinstance(self.mlp_only_layers, list) and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.num_hidden_layers
            for i in self.mlp_only_layers), "model.mlp_only_layers",
            f"must be a list of layer indices below model.num_hidden_layers ({self.num_hidden_layers}), "
            f"got {self.mlp_only_layers!r}")
        _require(self.shared_expert_intermediate_size >= 0, "model.shared_expert_intermediate_size",
                 f"must be >= 0, got {self.shared_expert_intermediate_size}")
        _require(self.router_aux_loss_coef >= 0, "model.router_aux_loss_coef",
                 f"must be >= 0, got {self.router_aux_loss_coef}")
        if self.model_type == "mixtral":  # every Mixtral layer is sparse, its experts intermediate_size wide
            for key in ("moe_intermediate_size", "mlp_only_layers", "decoder_sparse_step",
                        "shared_expert_intermediate_size"):
                _require(getattr(self, key) == getattr(ModelConfig(), key), f"model.{key}",
                         "is not a setting of a mixtral model (every layer is sparse, each expert "
                         "intermediate_size wide); remove it")
            _require(not self.attention_bias, "model.attention_bias", "must be false for mixtral (no attention biases)")
            _require(self.norm_topk_prob, "model.norm_topk_prob",
                     "must be true for mixtral (its router always renormalises the top-k weights)")
        if self.model_type == "gpt_oss":  # every layer sparse, each expert intermediate_size wide
            for key in ("moe_intermediate_size", "mlp_only_layers", "decoder_sparse_step",
                        "shared_expert_intermediate_size"):
                _require(getattr(self, key) == getattr(ModelConfig(), key), f"model.{key}",
                         "is not a setting of a gpt_oss model (every layer is sparse, each expert "
                         "intermediate_size wide); remove it")
            _require(self.norm_topk_prob, "model.norm_topk_prob",
                     "must be true for gpt_oss (its router takes the softmax of the top-k logits)")
        if self.model_type == "qwen3_moe":
            _require(self.shared_expert_intermediate_size == 0, "model.shared_expert_intermediate_size",
                     "is a qwen2_moe setting; a qwen3_moe model has no shared expert")
        if self.model_type == "qwen2_moe":
            _require(self.shared_expert_intermediate_size > 0, "model.shared_expert_intermediate_size",
                     "must be positive for qwen2_moe (its shared expert's width)")
        if self.model_type == "glm4_moe":
            validate_glm(self)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Map a Hugging Face config.json dict onto a ModelConfig; unsupported features are errors."""
        model_type = hf.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} in config.json is not supported; "
                              f"use one of {', '.join(SUPPORTED_MODEL_TYPES)}.")
        if hf.get("mlp_bias"):
            raise ConfigError("mlp_bias: true in config.json is not supported; only bias-free MLPs are.")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} in config.json is not supported; only silu (SwiGLU) is.")
        # transformers 4 writes rope_scaling (rope_theta beside it), 5 writes rope_parameters (rope_theta
        # inside); 5 reads rope_scaling first and prefers the rope_theta inside, and so do we.
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"rope_scaling in config.json must be a JSON object, got {rope!r}.")
        names = {f.name for f in dataclasses.fields(cls)}
        if model_type not in MOE_MODEL_TYPES:
            names -= set(MOE_FIELDS)
        if model_type != "glm4_moe":
            names -= set(GLM_FIELDS)
        if model_type != "gpt_oss":
            names -= set(GPT_OSS_FIELDS)
        data = {k: v for k, v in hf.items() if k in names}
        data["model_type"] = model_type
        if model_type in MOE_MODEL_TYPES:
            _moe_from_hf(hf, data, rope)
        data["rope_theta"] = rope.get("rope_theta", hf.get("rope_theta", cls.rope_theta))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        data["rope_scaling"] = None
        if rope_type not in ("default", None):  # validate() refuses the types model.rope_cache lacks
            data["rope_scaling"] = {"rope_type": rope_type,
                                    **{k: v for k, v in rope.items() if k not in ("type", "rope_type", "rope_theta", "partial_rotary_factor")}}
            if rope_type in ("llama3", "yarn"):  # transformers' precedence for the pretraining length
                fallback = rope.get("original_max_position_embeddings",
                                    hf.get("max_position_embeddings", cls.max_position_embeddings))
                data["rope_scaling"]["original_max_position_embeddings"] = hf.get(
                    "original_max_position_embeddings", fallback)
        if model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe") and not hf.get("use_sliding_window", False):
            data["sliding_window"] = None
        cfg = section_from_dict(cls, data, "model")
        cfg.validate()
        return cfg

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF config.json fields of this shape (architectures included)."""
        out = dataclasses.asdict(self)
        out["head_dim"] = self.head_size
        out["architectures"] = [ARCHITECTURES[self.model_type]]
        out["hidden_act"] = "silu"
        if self.model_type != "glm4_moe":
            for key in GLM_FIELDS:
                del out[key]
        if self.model_type != "gpt_oss":
            for key in GPT_OSS_FIELDS:
                del out[key]
        if not self.is_moe:
            for key in MOE_FIELDS:
                del out[key]
        elif self.model_type == "gpt_oss":  # its config.json's names; every layer sparse, no shared expert
            out["num_local_experts"] = out.pop("num_experts")
            for key in ("moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                        "shared_expert_intermediate_size"):
                del out[key]
        elif self.model_type == "mixtral":  # its config.json's names; every layer sparse, no shared expert
            out["num_local_experts"] = out.pop("num_experts")
            for key in ("moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                        "shared_expert_intermediate_size", "attention_bias"):
                del out[key]
            out["router_jitter_noise"] = 0.0
        elif self.model_type == "glm4_moe":  # its config.json's names; no decoder_sparse_step, no aux loss
            out["n_routed_experts"] = out.pop("num_experts")
            out["moe_intermediate_size"] = self.expert_size
            for key in ("decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size",
                        "router_aux_loss_coef"):
                del out[key]
            out["rope_parameters"] = {"rope_type": "default", **(self.rope_scaling or {}),  # transformers 5's form
                                      "rope_theta": self.rope_theta, "partial_rotary_factor": self.partial_rotary_factor}
        else:
            out["moe_intermediate_size"] = self.expert_size
            if self.model_type == "qwen2_moe":  # its name for the q/k/v biases
                out["qkv_bias"] = out.pop("attention_bias")
            else:
                del out["shared_expert_intermediate_size"]
        return out


def _moe_from_hf(hf: dict[str, Any], data: dict[str, Any], rope: dict[str, Any]) -> None:
    """The mixture-of-experts keys of an HF config.json into ``data`` (ModelConfig field names): the
    expert count under any of its names, q/k/v biases under qwen2_moe's, router noise refused,
    glm4_moe's keys with transformers' defaults and partial_rotary_factor from ``rope`` (the
    rope_parameters of transformers 5) or the top level (4)."""
    experts = hf.get("num_experts", hf.get("num_local_experts", hf.get("n_routed_experts")))
    if experts is not None:
        data["num_experts"] = experts
    if hf.get("router_jitter_noise"):
        raise ConfigError(f"router_jitter_noise {hf['router_jitter_noise']!r} in config.json is not supported; "
                          "set it to 0 (the router sees its input unperturbed).")
    if data["model_type"] == "qwen2_moe":
        data["attention_bias"] = hf.get("qkv_bias", True)
    if data["model_type"] in ("mixtral", "gpt_oss"):
        for key in ("moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size"):
            data.pop(key, None)
        data["norm_topk_prob"] = True
    if data["model_type"] == "glm4_moe":
        for key, default in GLM_HF_DEFAULTS.items():
            data[key] = hf.get(key, default)
        data["partial_rotary_factor"] = rope.get("partial_rotary_factor", data["partial_rotary_factor"])
        if "num_mtp_layers" in hf and "num_nextn_predict_layers" not in hf:
            data["num_nextn_predict_layers"] = hf["num_mtp_layers"]
    if data["model_type"] == "gpt_oss":
        data["attention_bias"] = hf.get("attention_bias", True)
