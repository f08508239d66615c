"""AdamW on one unit's flat host blocks, the learning-rate schedule, and global-norm clipping.

Every update path (the sink's host updates, the units resident on the device, the adapters of a
LoRA run) takes its step's clipping factor from :func:`step_clipping`, the one place that refuses
a step whose gradient norm is not finite (:class:`Diverged`, before anything is applied).

The update is torch's own fused AdamW kernel (``torch._fused_adamw_``, the kernel behind
``torch.optim.AdamW(fused=True)``), applied to two contiguous views per unit: the weight-decayed
matrices and the norms/biases after them (see :mod:`megatrain_ray.model.layout`), decayed too only with
``optim.decay_norms_and_biases``; or, where a C compiler is found, a one-pass kernel with the same
arithmetic (:mod:`megatrain_ray.engine.adamw_native`) run on a pool of threads (:class:`AdamWRunner`).
The math is ``torch.optim.AdamW``'s. With optim.state 8bit the runner applies the compact step
(:mod:`megatrain_ray.engine.compact`) instead, on the same pool.
"""

from __future__ import annotations

import itertools
import math
from concurrent.futures import ThreadPoolExecutor

import torch

from ..config import OptimConfig
from ..errors import Diverged
from . import adamw_native, compact


def run_pieces(pool, threads: int, count: int, fn) -> None:
    """Call ``fn(i)`` for every i in range(count) on up to ``threads`` of ``pool``'s threads (an
    Executor; None: here, in order), each thread taking the next index as it frees up, so pieces of
    uneven cost balance; the first error is raised once all have stopped."""
    if pool is None:
        for i in range(count):
            fn(i)
        return
    counter = itertools.count()

    def work() -> None:
        for i in counter:
            if i >= count:
                return
            fn(i)

    for f in [pool.submit(work) for _ in range(min(threads, count))]:
        f.result()


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor applied to every gradient, as ``torch.nn.utils.clip_grad_norm_`` computes it."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


def step_clipping(step: int, norm: float, max_norm: float) -> float:
    """Step ``step``'s clipping factor (:func:`clip_coefficient`) given its global gradient norm; raises
    :class:`Diverged`, in one sentence naming the step, when the norm is not finite."""
    if not math.isfinite(norm):
        raise Diverged(f"the gradient norm of step {step + 1} is {norm}; training diverged, lower optim.lr "
                       "or check the data.")
    return clip_coefficient(norm, max_norm)


def decay_ranges(numel: int, decay_numel: int, cfg: OptimConfig) -> tuple[tuple[int, int, float], ...]:
    """(start, end, weight decay) of a unit's two ranges: its matrices [0, decay_numel) get
    cfg.weight_decay, the norms and biases after them too with cfg.decay_norms_and_biases, else none."""
    rest = cfg.weight_decay if cfg.decay_norms_and_biases else 0.0
    return (0, decay_numel, cfg.weight_decay), (decay_numel, numel, rest)


CHUNK = 1 << 20
"""Elements per piece of a unit's update (4 MiB of fp32): with torch's kernels, small enough that the
upcast gradient, the update and the refreshed stream copy of a piece stay in cache, large enough
for all threads; with the native kernel, one thread's share of work at a time."""


class AdamWRunner:
    """One unit's AdamW step on ``threads`` CPU threads.

    With the native one-pass kernel (:mod:`megatrain_ray.engine.adamw_native`) a pool of threads pulls
    pieces of the unit from a shared counter, so a thread that the OS descheduled (the host also
    runs the compute worker, Ray and the loaders) delays only its own piece rather than a barrier
    of all threads. Without it, :func:`adamw_unit` runs on the calling thread with ``threads``
    intra-op threads.
    """

    def __init__(self, threads: int, native: bool = True):
        self.threads = max(1, threads)
        self.kernel = adamw_native.kernel() if native else None
        self.split = adamw_native.split_kernels() if self.kernel else None
        """The two passes of the update (:meth:`update_stream`, :meth:`update_master`), or None."""
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="adamw") if self.kernel else None

    def splits(self, master: torch.Tensor, grad: torch.Tensor, stream: torch.Tensor | None) -> bool:
        """Whether this unit's update can run in two passes: the native kernel, an fp32 master and a
        bf16 stream copy (see :func:`~megatrain_ray.engine.adamw_native.stream_pass`)."""
        return (self.split is not None and stream is not None and master.dtype == torch.float32
                and adamw_native.supports(master, grad, stream))

    def _by_pieces(self, numel: int, decay_numel: int, cfg: OptimConfig, call) -> None:
        """``call(a, b, weight_decay)`` for every piece [a, b) of a unit of ``numel`` elements (at most
        CHUNK, within one decay span), on the thread pool."""
        pieces = [(a, min(hi, a + CHUNK), wd) for lo, hi, wd in decay_ranges(numel, decay_numel, cfg)
                  for a in range(lo, hi, CHUNK)]
        run_pieces(self._pool, self.threads, len(pieces), lambda i: call(*pieces[i]))

    def update_stream(self, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor, stream: torch.Tensor, decay_numel: int, step: int, lr: float,
                      cfg: OptimConfig, grad_scale: float = 1.0) -> None:
        """The first pass of :meth:`update` where :meth:`splits`: the moments and the stream copy."""
        self._by_pieces(master.numel(), decay_numel, cfg, lambda a, b, wd: adamw_native.stream_pass(
            self.split[0], master, grad, exp_avg, exp_avg_sq, stream, a, b, lr, cfg.beta1, cfg.beta2, cfg.eps, wd,
            step, grad_scale))

    def update_master(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      decay_numel: int, step: int, lr: float, cfg: OptimConfig) -> None:
        """The second pass, after :meth:`update_stream`: the master weights from the new moments.
        Together the two are :meth:`update`, bit for bit."""
        self._by_pieces(master.numel(), decay_numel, cfg, lambda a, b, wd: adamw_native.master_pass(
            self.split[1], master, exp_avg, exp_avg_sq, a, b, lr, cfg.beta1, cfg.beta2, cfg.eps, wd, step))

    def update(self, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               stream: torch.Tensor | None, decay_numel: int, step: int, lr: float, cfg: OptimConfig,
               grad_scale: float = 1.0, unit: int = 0) -> None:
        """One AdamW step on one unit, in place (arguments as :func:`adamw_unit`)."""
        if self._pool is None or not adamw_native.supports(master, grad, stream):
            torch.set_num_threads(self.threads)
            adamw_unit(master, grad, exp_avg, exp_avg_sq, stream, decay_numel, step, lr, cfg, grad_scale, unit)
            return
        key = compact.rng_key(step, unit)
        self._by_pieces(master.numel(), decay_numel, cfg, lambda a, b, wd: adamw_native.piece(
            self.kernel, master, grad, exp_avg, exp_avg_sq, stream, a, b, lr, cfg.beta1, cfg.beta2, cfg.eps, wd,
            step, grad_scale, key))

    def update_compact(self, master: torch.Tensor, grad: torch.Tensor, qm: torch.Tensor, qv: torch.Tensor,
                       sm: torch.Tensor, sv: torch.Tensor, stream: torch.Tensor | None, decay_numel: int,
                       unit: int, step: int, lr: float, cfg: OptimConfig, grad_scale: float = 1.0) -> None:
        """One compact AdamW step on unit ``unit``, in place (see :mod:`megatrain_ray.engine.compact`).

        master: [n] bf16; grad: [n] bf16/fp32 (may alias ``stream``); qm, qv: [n] uint8 codes; sm, sv:
        [ceil(n / BLOCK)] fp32 block scales; stream: a compute-dtype copy to refresh, or None.
        Pieces are whole blocks (a block's scale is one thread's), each on the native kernel where
        it was built, else on :func:`~megatrain_ray.engine.compact.step_reference` one after another.
        """
        rest = cfg.weight_decay if cfg.decay_norms_and_biases else 0.0
        c = compact.StepConstants.of(step, lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, rest, grad_scale)
        key = compact.rng_key(step, unit)
        fn = adamw_native.compact_kernel() if self.kernel is not None else None
        n = master.numel()
        pieces = [(a, min(n, a + CHUNK)) for a in range(0, n, CHUNK)]  # CHUNK is a multiple of BLOCK
        if fn is None or grad.dtype not in (torch.float32, torch.bfloat16):
            torch.set_num_threads(self.threads)
            for a, b in pieces:
                s = slice(a // compact.BLOCK, compact.num_blocks(b))
                compact.step_reference(master[a:b], grad[a:b], qm[a:b], qv[a:b], sm[s], sv[s], decay_numel - a, c,
                                       key, a)
        else:
            def work(i: int) -> None:
                a, b = pieces[i]
                adamw_native.compact_piece(fn, master, grad, qm, qv, sm, sv, a, b, decay_numel, c, key)

            run_pieces(self._pool, self.threads, len(pieces), work)
        if stream is not None:
            stream.copy_(master)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


def adamw_unit(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               stream: torch.Tensor | None, decay_numel: int, step: int, lr: float, cfg: OptimConfig,
               grad_scale: float = 1.0, unit: int = 0, pieces: bool = True) -> None:
    """One AdamW step on one unit, in place, piece by piece, with torch's kernels.

    master: [n] fp32 or bf16 (bf16 is updated through an fp32 temporary and rounded back
    stochastically, with the random bits of :mod:`megatrain_ray.engine.compact` for ``unit``);
    grad: [n] in any float dtype, scaled by ``grad_scale`` (the clipping factor) as it is upcast;
    it may alias ``stream``, since each piece's gradient is read before its stream copy is
    rewritten; exp_avg, exp_avg_sq: [n] fp32; stream: [n] compute-dtype copy to refresh, or None.
    The first ``decay_numel`` elements (the matrices) get weight decay, the rest only with
    ``cfg.decay_norms_and_biases`` (:func:`decay_ranges`). ``step`` is the 1-based AdamW step. The
    tensors may live on any one device; ``pieces`` False updates each span in one call (on a GPU,
    where cache-sized pieces would only add kernel launches).
    """
    size = CHUNK if pieces else max(1, master.numel())
    step_t = torch.tensor(float(step), device=master.device)
    piece = min(size, master.numel())
    fp32 = dict(dtype=torch.float32, device=master.device)
    g_buf = torch.empty(piece, **fp32) if grad.dtype != torch.float32 else None  # an upcast gradient piece
    p_buf = torch.empty(piece, **fp32) if master.dtype != torch.float32 else None
    for lo, hi, weight_decay in decay_ranges(master.numel(), decay_numel, cfg):
        for a in range(lo, hi, size):
            b = min(hi, a + size)
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
                rnd = compact.random_bits(torch.arange(a, b), compact.rng_key(step, unit))[0]
                p = compact.round_bf16(p, rnd)
                master[a:b].copy_(p)
            if stream is not None:
                stream[a:b].copy_(p)
