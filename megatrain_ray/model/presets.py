"""Named model shapes for the benchmark and its peers: the model fields of each preset.

A preset is a dict of :class:`~megatrain_ray.config.ModelConfig` fields (HF config.json names):
``tiny`` (4 layers, hidden 256) for tests and smoke runs, ``1b`` the Llama 3.2 1B shape, ``3b`` and
``7b``, ``14b``, ``32b`` the Qwen2.5 3B, 7B, 14B and 32B shapes (``--layers`` makes a shorter model of
the same width, e.g. a ~20B model at the 32B width with 38 layers).
"""

from __future__ import annotations

from ..config import ModelConfig
from .layout import StoreLayout

PRESETS = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
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
}


def preset_shape(preset: str, layers: int | None = None) -> dict:
    """The preset's model fields, with ``num_hidden_layers`` replaced when ``layers`` is given."""
    return {**PRESETS[preset], **({"num_hidden_layers": layers} if layers else {})}


def preset_model(preset: str, layers: int | None = None) -> ModelConfig:
    """The model a preset benchmarks (positions up to 32768, so any --seq-len fits)."""
    return ModelConfig(**preset_shape(preset, layers), max_position_embeddings=32768)


def model_params(preset: str, layers: int | None = None) -> int:
    return StoreLayout.build(preset_model(preset, layers)).num_params
