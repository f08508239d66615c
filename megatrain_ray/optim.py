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


CHUNK = 1 << 20
"""Elements per piece of a unit's update (4 MiB of fp32): small enough that the upcast gradient,
the update and the refreshed stream copy of a piece stay in cache, large enough for all threads."""


def adamw_unit(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               stream: torch.Tensor | None, decay_numel: int, step: int, lr: float, cfg: OptimConfig,
               grad_scale: float = 1.0) -> None:
    """One AdamW step on one unit, in place, piece by piece.

    master: [n] fp32 or bf16 (bf16 is updated through an fp32 temporary and rounded back);
    grad: [n] in any float dtype, scaled by ``grad_scale`` (the clipping factor) as it is upcast;
    it may alias ``stream``, since each piece's gradient is read before its stream copy is
    rewritten; exp_avg, exp_avg_sq: [n] fp32; stream: [n] compute-dtype copy to refresh, or None.
    The first ``decay_numel`` elements get weight decay. ``step`` is the 1-based AdamW step.
    """
    step_t = torch.tensor(float(step))
    g_buf = torch.empty(min(CHUNK, master.numel()), dtype=torch.float32)
    p_buf = g_buf.new_empty(g_buf.shape) if master.dtype != torch.float32 else None
    for lo, hi, weight_decay in ((0, decay_numel, cfg.weight_decay), (decay_numel, master.numel(), 0.0)):
        for a in range(lo, hi, CHUNK):
            b = min(hi, a + CHUNK)
            # An fp32 gradient is scaled in place: its block is scratch once read (even when it
            # aliases the stream copy, which is rewritten only after this piece's update).
            if grad.dtype == torch.float32:
                g = grad[a:b].mul_(grad_scale) if grad_scale != 1.0 else grad[a:b]
            else:
                g = torch.mul(grad[a:b], grad_scale, out=g_buf[:b - a])
            p = master[a:b] if p_buf is None else p_buf[:b - a].copy_(master[a:b])
            torch._fused_adamw_(
                [p], [g], [exp_avg[a:b]], [exp_avg_sq[a:b]], [], [step_t], lr=lr, beta1=cfg.beta1,
                beta2=cfg.beta2, weight_decay=weight_decay, eps=cfg.eps, amsgrad=False, maximize=False)
            if p_buf is not None:
                master[a:b].copy_(p)
            if stream is not None:
                stream[a:b].copy_(p)
