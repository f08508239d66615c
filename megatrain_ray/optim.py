"""AdamW on one unit's flat host blocks, the learning-rate schedule, and global-norm clipping.

The update is torch's own fused AdamW kernel (``torch._fused_adamw_``, the kernel behind
``torch.optim.AdamW(fused=True)``, multithreaded on the CPU), applied to two contiguous views per
unit: the weight-decayed matrices and the undecayed norms/biases (see :mod:`megatrain_ray.layout`).
The math is exactly ``torch.optim.AdamW``'s.
"""

from __future__ import annotations

import math

import torch

from .config import OptimConfig


def lr_at(cfg: OptimConfig, step: int, total_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then cosine to min_lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor applied to every gradient, as ``torch.nn.utils.clip_grad_norm_`` computes it."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


def adamw_unit(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               decay_numel: int, step: int, lr: float, cfg: OptimConfig, grad_scale: float = 1.0) -> None:
    """One AdamW step on one unit, in place.

    param: [n] master weights (fp32, or bf16: updated through an fp32 temporary);
    grad, exp_avg, exp_avg_sq: [n] fp32; the first ``decay_numel`` elements get weight decay.
    ``step`` is the 1-based AdamW step count; ``grad_scale`` is the clipping factor.
    """
    if grad_scale != 1.0:
        grad.mul_(grad_scale)
    work = param if param.dtype == torch.float32 else param.float()
    regions = ((slice(0, decay_numel), cfg.weight_decay), (slice(decay_numel, param.numel()), 0.0))
    for region, weight_decay in regions:
        if region.stop <= region.start:
            continue
        torch._fused_adamw_(
            [work[region]], [grad[region]], [exp_avg[region]], [exp_avg_sq[region]], [],
            [torch.tensor(float(step))], lr=lr, beta1=cfg.beta1, beta2=cfg.beta2,
            weight_decay=weight_decay, eps=cfg.eps, amsgrad=False, maximize=False)
    if work is not param:
        param.copy_(work)
