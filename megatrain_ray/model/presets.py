"""Named model shapes for the benchmark and its peers: the model fields of each preset.

A preset is a dict of :class:`~megatrain_ray.config.ModelConfig` fields (HF config.json names), and a
name means one model wherever it is used: ``tiny`` is what ``megatrain-ray train`` runs with no
arguments (``configs/tiny.yaml``'s model: 2 layers, hidden 64, byte-level, 134 K parameters);
``small`` (4 layers, hidden 256, a 4,096-token vocabulary: 5 M parameters) for smoke runs, and
``small-moe`` of the same width, a Qwen3-MoE whose every layer has 8 experts, top-2; ``1b`` the
Llama 3.2 1B shape, ``3b`` and ``7b``, ``14b``, ``32b`` the Qwen2.5 3B, 7B, 14B and 32B shapes
(``--layers`` makes a shorter model of the same width, e.g. a ~20B model at the 32B width with 38
layers), ``70b`` the Llama 3.1 70B shape. Larger mixtures of experts: ``qwen3-30b-a3b`` (48 layers
of 128 experts, top-8; 30.5B parameters, 3.3B active) and ``mixtral-8x7b`` (32 layers of 8 experts, top-2; 46.7B,
12.9B active), whose ``--layers`` cuts keep every layer's experts (12 of Qwen3-30B-A3B's 48 layers:
8.1B); ``glm-4.5-air`` (GLM-4.5-Air's published config.json: 46 layers, the first dense, the others
128 routed experts top-8 of 1,408 wide beside one shared expert, 96 heads of 128 with half of each
rotated, q/k/v biases; 106.9B parameters without its multi-token-prediction layer, 13.4B active, 12.2B
without the embedding and the LM head: the card's 12B); ``gpt-oss-20b`` (24 layers of 32 experts,
top-4; 20.9B, 4.2B active, 3.6B without the embedding as OpenAI counts) and ``gpt-oss-120b`` (36
layers of 128 experts, top-4; 116.8B, 5.7B active, 5.1B), their published config.json's shapes
(sliding window 128 on alternate layers, YaRN x32 over 4,096 positions).
"""

from __future__ import annotations

from ..config import ModelConfig
from .layout import StoreLayout

PRESETS = {
    "tiny": dict(model_type="llama", vocab_size=260, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4),
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=4096),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "3b": dict(model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
               num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, rope_theta=1e6),
    "7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rope_theta=1e6),
    "14b": dict(model_type="qwen2", hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, rope_theta=1e6),
    "32b": dict(model_type="qwen2", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, rope_theta=1e6),
    "small-moe": dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=4096, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          rope_theta=1e6, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          norm_topk_prob=True),
    "glm-4.5-air": dict(model_type="glm4_moe", hidden_size=4096, intermediate_size=10944, num_hidden_layers=46,
                        num_attention_heads=96, num_key_value_heads=8, head_dim=128, vocab_size=151552,
                        rope_theta=1e6, rms_norm_eps=1e-5, attention_bias=True, partial_rotary_factor=0.5,
                        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                        norm_topk_prob=True, num_nextn_predict_layers=1),
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, rope_theta=1e6,
                         rms_norm_eps=1e-5, num_experts=8, num_experts_per_tok=2),
}
GPT_OSS_SHAPE = dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                     num_key_value_heads=8, head_dim=64, vocab_size=201088, rope_theta=150000.0, rms_norm_eps=1e-5,
                     sliding_window=128, num_experts_per_tok=4, rope_scaling={
                         "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096})
"""gpt-oss's shape but its depth and expert count (layer_types: its default alternation)."""
PRESETS["gpt-oss-20b"] = dict(GPT_OSS_SHAPE, num_hidden_layers=24, num_experts=32)
PRESETS["gpt-oss-120b"] = dict(GPT_OSS_SHAPE, num_hidden_layers=36, num_experts=128)


def preset_shape(preset: str, layers: int | None = None) -> dict:
    """The preset's model fields, with ``num_hidden_layers`` replaced when ``layers`` is given."""
    return {**PRESETS[preset], **({"num_hidden_layers": layers} if layers else {})}


def preset_model(preset: str, layers: int | None = None) -> ModelConfig:
    """The model a preset benchmarks (positions up to 32768, so any --seq-len fits)."""
    return ModelConfig(**preset_shape(preset, layers), max_position_embeddings=32768)


def model_params(preset: str, layers: int | None = None) -> int:
    return StoreLayout.build(preset_model(preset, layers)).num_params
