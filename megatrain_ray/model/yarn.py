"""YaRN's RoPE frequencies (``rope_scaling: {rope_type: yarn, ...}``, gpt-oss), as transformers'
``_compute_yarn_parameters`` computes them: each frequency is blended between its original value
(extrapolation, the fast-rotating dimensions) and its value divided by ``factor`` (interpolation,
the slow ones) by a linear ramp over the dimensions between the two correction bounds, which are
where a dimension completes ``beta_fast`` and ``beta_slow`` rotations over
original_max_position_embeddings (rounded outwards with ``truncate``, transformers' default); the
cos and sin tables are then multiplied by the attention factor (given, or 0.1 ln(factor) + 1).
"""

from __future__ import annotations

import math

import torch


def _correction_dim(rotations: float, d: int, base: float, length: int) -> float:
    """The (fractional) dimension index whose wavelength fits ``rotations`` times in ``length`` positions."""
    return d * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_frequencies(rs: dict, base: float, d: int, device) -> tuple[torch.Tensor, float]:
    """rs: a validated yarn rope_scaling; base: rope_theta; d: the head size -> (inv_freq [d/2] fp32,
    the attention factor the cos/sin tables are multiplied by)."""
    factor = float(rs["factor"])
    length = int(rs["original_max_position_embeddings"])
    attention = rs.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    low = _correction_dim(rs.get("beta_fast") or 32, d, base, length)
    high = _correction_dim(rs.get("beta_slow") or 1, d, base, length)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # a ramp of no width: a step
    pos = base ** (torch.arange(0, d, 2, device=device, dtype=torch.float) / d)
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (extrapolation), 0: divided by factor (interpolation)
    inv_freq = (1.0 / (factor * pos)) * (1 - keep) + (1.0 / pos) * keep
    return inv_freq, float(attention)
