"""The supported model families: their names, the config.json fields only some of them have, and
the checks those fields and RoPE scalings get (called by :meth:`ModelConfig.validate
<megatrain_ray.config.model.ModelConfig.validate>`).
"""

from __future__ import annotations

from .fields import require as _require

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "glm4_moe": "Glm4MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}
"""model_type -> the HF ``architectures`` entry of its causal LM: the one map of supported families
(config.json is read and written through it, by :class:`ModelConfig` and megatrain_ray.io.hf_io)."""
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "gpt_oss")
"""The mixture-of-experts families (see :mod:`megatrain_ray.model.moe`)."""
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size",
              "router_aux_loss_coef", "output_router_logits")
"""The fields only a mixture of experts has (a dense family's config.json carries none of them)."""
GLM_FIELDS = ("n_shared_experts", "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor",
              "use_qk_norm", "partial_rotary_factor", "num_nextn_predict_layers")
"""The fields only glm4_moe has (GLM-4.5 / 4.5-Air / 4.6; the other families' config.json carry none)."""
GLM_HF_DEFAULTS = dict(n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                       routed_scaling_factor=1.0, norm_topk_prob=True, use_qk_norm=False, partial_rotary_factor=0.5,
                       num_nextn_predict_layers=1)
"""transformers' Glm4MoeConfig defaults of those fields, for a config.json that leaves one out."""
LLAMA3_ROPE_KEYS = ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
"""The keys of a ``rope_type: llama3`` model.rope_scaling (Llama 3.1 / 3.2 / 3.3), as in HF config.json."""
YARN_ROPE_KEYS = ("rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate",
                  "attention_factor")
"""The keys of a ``rope_type: yarn`` model.rope_scaling (gpt-oss), as in HF config.json: factor and
original_max_position_embeddings required, beta_fast (32), beta_slow (1), truncate (true) and
attention_factor (0.1 ln(factor) + 1) optional with transformers' defaults."""
GPT_OSS_FIELDS = ("layer_types", "swiglu_alpha", "swiglu_limit")
"""The fields only gpt-oss has (another family's config.json carries none of them)."""
LAYER_TYPES = ("full_attention", "sliding_attention")
"""The values of model.layer_types: causal attention over the whole sequence, or limited to the
last model.sliding_window positions."""


def validate_glm(cfg) -> None:
    """The checks of a glm4_moe shape (``cfg``: a ModelConfig)."""
    for key in ("decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size"):
        _require(getattr(cfg, key) == getattr(type(cfg)(), key), f"model.{key}",
                 "is not a setting of a glm4_moe model (its first first_k_dense_replace layers are dense, "
                 "its shared experts n_shared_experts x moe_intermediate_size wide); remove it")
    _require(not cfg.output_router_logits, "model.output_router_logits",
             "must be false for glm4_moe: transformers computes no load-balancing loss for it (its "
             "router's e_score_correction_bias, held frozen here, balances the load instead)")
    e = cfg.num_experts
    _require(cfg.n_group > 0 and e % cfg.n_group == 0 and (cfg.n_group == 1 or e // cfg.n_group >= 2),
             "model.n_group", f"must divide model.num_experts ({e}) into groups of at least 2, got {cfg.n_group}")
    _require(0 < cfg.topk_group <= cfg.n_group, "model.topk_group",
             f"must be between 1 and model.n_group ({cfg.n_group}), got {cfg.topk_group}")
    _require(cfg.topk_group * (e // cfg.n_group) >= cfg.num_experts_per_tok, "model.topk_group",
             f"keeps {cfg.topk_group} groups of {e // cfg.n_group} experts, fewer than "
             f"model.num_experts_per_tok ({cfg.num_experts_per_tok})")
    _require(cfg.routed_scaling_factor > 0, "model.routed_scaling_factor",
             f"must be positive, got {cfg.routed_scaling_factor}")
    _require(0 <= cfg.first_k_dense_replace <= cfg.num_hidden_layers, "model.first_k_dense_replace",
             f"must be between 0 and model.num_hidden_layers ({cfg.num_hidden_layers}), "
             f"got {cfg.first_k_dense_replace}")
    for key in ("n_shared_experts", "num_nextn_predict_layers"):
        _require(getattr(cfg, key) >= 0, f"model.{key}", f"must be >= 0, got {getattr(cfg, key)}")
    f = cfg.partial_rotary_factor
    _require(0 < f <= 1 and cfg.rotary_dim > 0 and cfg.rotary_dim % 2 == 0, "model.partial_rotary_factor",
             f"must be in (0, 1] and rotate an even number of dims of model.head_dim ({cfg.head_size}), got {f}")


def validate_gpt_oss(cfg) -> None:
    """The checks of a gpt_oss shape (``cfg``: a ModelConfig)."""
    types = cfg.layer_types
    _require(isinstance(types, list) and len(types) == cfg.num_hidden_layers and all(t in LAYER_TYPES for t in types),
             "model.layer_types", f"must list one of {', '.join(LAYER_TYPES)} per layer "
             f"({cfg.num_hidden_layers}), got {types!r}")
    _require(cfg.sliding_window is not None or "sliding_attention" not in types, "model.sliding_window",
             "must be set when model.layer_types has sliding_attention layers")
    _require(cfg.swiglu_alpha > 0, "model.swiglu_alpha", f"must be positive, got {cfg.swiglu_alpha}")
    _require(cfg.swiglu_limit > 0, "model.swiglu_limit", f"must be positive, got {cfg.swiglu_limit}")


def validate_rope_scaling(rs) -> None:
    """The checks of a model.rope_scaling that is not null: a llama3 or a yarn one."""
    _require(isinstance(rs, dict), "model.rope_scaling", f"must be a mapping (or null), got {rs!r}")
    rope_type = rs.get("rope_type")
    _require(rope_type in ("llama3", "yarn"), "model.rope_scaling",
             f"has rope_type {rope_type!r}, which is not supported; supported are 'llama3' "
             "(Llama 3.1 to 3.3), 'yarn' (gpt-oss) and null (plain RoPE)")
    if rope_type == "yarn":
        return _validate_yarn(rs)
    unknown = sorted(set(rs) - set(LLAMA3_ROPE_KEYS))
    _require(not unknown, f"model.rope_scaling.{unknown[0] if unknown else ''}",
             f"is not a key of a llama3 rope_scaling; its keys are {', '.join(LLAMA3_ROPE_KEYS)}")
    for key in LLAMA3_ROPE_KEYS[1:]:
        value = rs.get(key)
        _require(isinstance(value, (int, float)) and not isinstance(value, bool), f"model.rope_scaling.{key}",
                 f"must be a number, got {value!r}")
    _require(rs["factor"] >= 1, "model.rope_scaling.factor", f"must be >= 1, got {rs['factor']}")
    _require(rs["low_freq_factor"] > 0, "model.rope_scaling.low_freq_factor",
             f"must be positive, got {rs['low_freq_factor']}")
    _require(rs["high_freq_factor"] > rs["low_freq_factor"], "model.rope_scaling.high_freq_factor",
             f"must exceed low_freq_factor ({rs['low_freq_factor']}), got {rs['high_freq_factor']}")
    original = rs["original_max_position_embeddings"]
    _require(original > 0 and float(original).is_integer(), "model.rope_scaling.original_max_position_embeddings",
             f"must be a positive integer, got {original!r}")

def _validate_yarn(rs) -> None:
    unknown = sorted(set(rs) - set(YARN_ROPE_KEYS))
    _require(not unknown, f"model.rope_scaling.{unknown[0] if unknown else ''}",
             f"is not a supported key of a yarn rope_scaling; its keys are {', '.join(YARN_ROPE_KEYS)}")
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor"):
        value = rs.get(key)
        _require((value is None and key not in ("factor", "original_max_position_embeddings"))
                 or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0),
                 f"model.rope_scaling.{key}", f"must be a positive number, got {value!r}")
    _require(rs["factor"] >= 1, "model.rope_scaling.factor", f"must be >= 1, got {rs['factor']}")
    _require(isinstance(rs.get("truncate", True), bool), "model.rope_scaling.truncate",
             f"must be true or false, got {rs.get('truncate')!r}")
