"""One unit's AdamW in float64 beside an fp32 kernel's, and how far an fp32 kernel may land from it.

Two fp32 AdamW kernels (the host's native one, torch's fused CPU or CUDA kernel) compute the same
formula with different roundings: a multiply-add or a lerp for the moments, the clipping factor
applied to the gradient here or there, the bias corrections from another pow. Their distance is not
a relative tolerance on the result: a first moment summed from gradients of both signs can cancel to
almost zero while its rounding error stays that of its terms, so on such an element any two correct
kernels differ by far more than a few ulps *of the moment*. :class:`AdamWTruth` steps the same
update in float64 (rounding 2^29 times finer: the truth) and carries, per element, a bound on an
fp32 kernel's distance from it, derived from the magnitudes of the terms each fp32 operation rounds
(u = 2^-24, the unit roundoff; each operation's result is off by at most u of its magnitude):

- the constants: a kernel may hold b1, b2 and what it derives from them in fp32, so 1 - b (from b
  rounded to fp32) is off by b u / (1 - b) of itself (9u for b1 = 0.9, ~1000u for b2 = 0.999), and a
  bias correction 1 - b^t by (t b^t u + u) / (1 - b^t);
- the first moment, m_t = b1 m_{t-1} + (1 - b1) g_t: a step rounds the scaled gradient (the clipping
  factor computed in fp32 from the squared norms too: up to 4u of it), two products and a sum, each
  at most the step's term magnitude M_t = b1 M_{t-1} + (1 - b1) |g_t| (>= |m_t|): 8u M_t a step, and
  1 - b1's error of M_t, on top of the earlier steps' error decayed by b1;
- the second moment (no cancellation: every term is positive): the square of a gradient off by 5u
  and the same products and sum, 16u v_t a step, and 1 - b2's error of v_t, on top of the earlier
  error decayed by b2;
- the master weights: the decay's product (u |p| twice), then the step lr / bc1 * m / (sqrt(v) / sqrt(bc2)
  + eps), whose error is the first moment's over the denominator, and the step's size times half the
  second moment's relative error and half bc2's, bc1's, and the square root's, the division's and
  the products' (8u); added each step.

A kernel that is wrong (a missed decay, a wrong bias correction, another step count, the clipping
factor not applied) is off by orders of magnitude more than these bounds after one step.
"""

from __future__ import annotations

import torch

U = 2.0**-24
"""fp32's unit roundoff."""


def _one_minus(beta: float) -> float:
    """The relative error of 1 - beta computed from beta rounded to fp32 (and rounded itself)."""
    return beta * U / (1 - beta) + U


def _correction(beta: float, t: int) -> float:
    """The relative error of the bias correction 1 - beta^t computed in fp32."""
    return (t * beta**t * U + U) / (1 - beta**t) + U


class AdamWTruth:
    """One fp32 unit's AdamW, from ``master`` ([n] fp32) with zero moments, in float64 (see the module
    docstring); ``ranges``: its (start, end, weight decay) spans (``optim.decay_ranges``)."""

    def __init__(self, master: torch.Tensor, ranges, beta1: float, beta2: float, eps: float):
        self.p = master.double().clone()
        self.m, self.v, self.mag = (torch.zeros_like(self.p) for _ in range(3))
        self.err_m, self.err_v, self.err_p = (torch.zeros_like(self.p) for _ in range(3))
        self.wd = torch.zeros_like(self.p)
        for lo, hi, weight_decay in ranges:
            self.wd[lo:hi] = weight_decay
        self.b1, self.b2, self.eps, self.t = beta1, beta2, eps, 0

    def step(self, grad: torch.Tensor, coef: float, lr: float) -> None:
        """One step on ``grad`` ([n], any float dtype) scaled by the clipping factor ``coef``, at ``lr``."""
        b1, b2, self.t = self.b1, self.b2, self.t + 1
        g = grad.double() * coef
        self.err_p += 2 * U * self.p.abs()  # the decay's product and its rounding
        self.p *= 1 - lr * self.wd
        self.m = b1 * self.m + (1 - b1) * g
        self.v = b2 * self.v + (1 - b2) * g * g
        self.mag = b1 * self.mag + (1 - b1) * g.abs()
        self.err_m = b1 * self.err_m + (8 * U + _one_minus(b1)) * self.mag
        self.err_v = b2 * self.err_v + (16 * U + _one_minus(b2)) * self.v
        bc1, bc2 = 1 - b1**self.t, 1 - b2**self.t
        denom = self.v.sqrt() / bc2**0.5 + self.eps
        upd = lr / bc1 * self.m / denom
        rel = (0.5 * self.err_v / self.v.clamp_min(1e-300) + 0.5 * _correction(b2, self.t) + _correction(b1, self.t)
               + 8 * U)
        self.err_p += lr / bc1 * self.err_m / denom + upd.abs() * rel + U * (self.p - upd).abs()
        self.p -= upd

    def assert_close(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     what: str = "") -> dict[str, float]:
        """Assert an fp32 kernel's state ([n] each, any device) is within the bounds of the truth; returns
        each quantity's largest distance as a share of its bound (<= 1)."""
        shares = {}
        for name, ours, truth, err in (("exp_avg", exp_avg, self.m, self.err_m),
                                       ("exp_avg_sq", exp_avg_sq, self.v, self.err_v),
                                       ("master", master, self.p, self.err_p)):
            dist = (ours.detach().cpu().double() - truth).abs()
            over = dist > err
            assert not over.any(), (
                f"{what} {name}: {int(over.sum())} of {dist.numel()} elements farther from the float64 truth than "
                f"fp32 rounding allows (the worst at {int((dist - err).argmax())}: {float(dist.max()):.3g})")
            shares[name] = float((dist / err.clamp_min(1e-300)).max())
        return shares
