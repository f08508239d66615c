"""AdamW on one unit's flat host blocks, the learning-rate schedule, and global-norm clipping.

The update is torch's own fused AdamW kernel (``torch._fused_adamw_``, the kernel behind
``torch.optim.AdamW(fused=True)``), applied to two contiguous views per unit: the weight-decayed
matrices and the undecayed norms/biases (see :mod:`megatrain_ray.layout`), in cache-sized pieces
spread over a pool of threads (:class:`AdamWRunner`). The math is exactly ``torch.optim.AdamW``'s.
"""

from __future__ import annotations

import itertools
import math
import threading
from concurrent.futures import ThreadPoolExecutor

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


CHUNK = 1 << 17
"""Elements per piece of a unit's update (512 KiB of fp32): one thread's piece — upcast gradient,
master, moments and refreshed stream copy — stays in its core's L2 cache through the whole update."""


class AdamWRunner:
    """Runs :func:`adamw_unit` on ``threads`` Python threads pulling pieces from a shared counter.

    Each piece is updated start to finish by one thread with torch's kernels single-threaded, so
    its data stay in that core's cache between the upcast, the update and the stream refresh; a
    thread that the OS descheduled (the host also runs the compute worker's launch thread, Ray and
    the loaders) delays only its own piece, never a barrier of all threads.
    """

    def __init__(self, threads: int):
        self.threads = max(1, threads)
        # torch's intra-op thread count is per thread (an OpenMP setting): 1 in the pool's
        # threads, untouched in the caller's.
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="adamw",
                                        initializer=torch.set_num_threads, initargs=(1,))
        self._local = threading.local()

    def update(self, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               stream: torch.Tensor | None, decay_numel: int, step: int, lr: float, cfg: OptimConfig,
               grad_scale: float = 1.0) -> None:
        """One AdamW step on one unit, in place (arguments as :func:`adamw_unit`)."""
        pieces = [(a, min(hi, a + CHUNK), wd) for lo, hi, wd in
                  ((0, decay_numel, cfg.weight_decay), (decay_numel, master.numel(), 0.0))
                  for a in range(lo, hi, CHUNK)]
        step_t = torch.tensor(float(step))
        args = (master, grad, exp_avg, exp_avg_sq, stream, step_t, lr, cfg, grad_scale)
        counter = itertools.count()

        def work() -> None:
            bufs = self._buffers(master.dtype)
            for i in counter:
                if i >= len(pieces):
                    return
                _update_piece(pieces[i], bufs, *args)

        for f in [self._pool.submit(work) for _ in range(min(self.threads, len(pieces)))]:
            f.result()

    def _buffers(self, master_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This thread's fp32 scratch for one piece's gradient (and master, when it is not fp32)."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = (torch.empty(CHUNK), torch.empty(CHUNK))
        return bufs[0], bufs[1] if master_dtype != torch.float32 else None

    def close(self) -> None:
        self._pool.shutdown()


def _update_piece(piece: tuple[int, int, float], bufs: tuple[torch.Tensor, torch.Tensor | None],
                  master, grad, exp_avg, exp_avg_sq, stream, step_t, lr, cfg, grad_scale) -> None:
    """AdamW on elements [a, b) of one unit, with weight decay ``wd`` (see :func:`adamw_unit`)."""
    a, b, weight_decay = piece
    g_buf, p_buf = bufs
    # An fp32 gradient is scaled in place: its block is scratch once read (even when it aliases
    # the stream copy, which is rewritten only after this piece's update).
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


def adamw_unit(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               stream: torch.Tensor | None, decay_numel: int, step: int, lr: float, cfg: OptimConfig,
               grad_scale: float = 1.0) -> None:
    """One AdamW step on one unit, in place, piece by piece, on the calling thread.

    master: [n] fp32 or bf16 (bf16 is updated through an fp32 temporary and rounded back);
    grad: [n] in any float dtype, scaled by ``grad_scale`` (the clipping factor) as it is upcast;
    it may alias ``stream``, since each piece's gradient is read before its stream copy is
    rewritten; exp_avg, exp_avg_sq: [n] fp32; stream: [n] compute-dtype copy to refresh, or None.
    The first ``decay_numel`` elements get weight decay. ``step`` is the 1-based AdamW step.
    Parallel across threads through :class:`AdamWRunner`.
    """
    n = min(CHUNK, master.numel())
    bufs = (torch.empty(n), torch.empty(n) if master.dtype != torch.float32 else None)
    step_t = torch.tensor(float(step))
    for lo, hi, wd in ((0, decay_numel, cfg.weight_decay), (decay_numel, master.numel(), 0.0)):
        for a in range(lo, hi, CHUNK):
            _update_piece((a, min(hi, a + CHUNK), wd), bufs, master, grad, exp_avg, exp_avg_sq, stream,
                          step_t, lr, cfg, grad_scale)
