"""A one-pass AdamW kernel in C for the host update, built on first use with the system C compiler.

The update of one unit reads the gradient (bf16 or fp32, scaled by the clipping factor), the
master weights and both moments, and writes the master, the moments and the bf16 stream copy, in
a single pass over memory: 28 bytes per parameter with fp32 master and bf16 gradient, which is
what bounds AdamW on a CPU. Doing the same with torch's kernels takes three passes (upcast,
fused AdamW, downcast). The arithmetic follows ``torch._fused_adamw_`` (decoupled weight decay,
``lerp`` for the first moment, bias corrections as scalars), in fp32.

The same update also runs split in two passes (:func:`stream_pass`, :func:`master_pass`) where
the next forward waits on it: the first writes the moments and the stream copy (24 bytes per
parameter), the second, later, the fp32 master from the new moments (16 bytes); the same
arithmetic, so the same bits (see :mod:`megatrain_ray.engine.sink.gradient_sink`).

The kernel has no threads of its own: :class:`~megatrain_ray.engine.optim.AdamWRunner` calls it from a
pool of Python threads on pieces of a unit (``ctypes`` releases the GIL for the call). It is
compiled with ``cc -O3 -march=native -fno-math-errno`` into a per-user cache directory and loaded with
``ctypes``; where no compiler is found, :func:`kernel` returns None and the update runs on
torch's kernels instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading

import torch

from .compact import BLOCK

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, NaN stays NaN */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline uint32_t mix32(uint32_t x) {  /* Wellons' lowbias32, as megatrain_ray.engine.compact.mix32 */
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16; return x;
}
static inline uint16_t sr_bf16(float f, uint32_t h) {  /* round stochastically with 16 random bits */
    uint32_t u; memcpy(&u, &f, 4); return (uint16_t)((u + (h & 0xffffu)) >> 16);
}
#define SR(i) sr_bf16(param, mix32((uint32_t)(idx0 + (i)) ^ key))

/* AdamW on elements [0, n) of one piece. p: master (fp32 when p_bf16 == 0, else bf16, rounded
   stochastically with the random bits of element idx0 + i under key); g: gradient (bf16 when g_bf16,
   else fp32); m, v: fp32 moments; s: bf16 stream copy to refresh, or NULL. */
#define BODY(LOAD_P, STORE_P, LOAD_G, STORE_S)                                          \
    for (int64_t i = 0; i < n; i++) {                                                   \
        float grad = (LOAD_G) * scale;                                                  \
        float param = (LOAD_P) * decay;                                                 \
        float mi = m[i] + w1 * (grad - m[i]);                                           \
        float vi = v[i] * b2 + grad * grad * (1.0f - b2);                               \
        m[i] = mi; v[i] = vi;                                                           \
        param -= step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);                         \
        STORE_P; STORE_S;                                                               \
    }

void adamw_piece(void *p_, int p_bf16, const void *g_, int g_bf16, float *restrict m, float *restrict v,
                 uint16_t *s, int64_t n, float lr, float b1, float b2, float eps, float wd,
                 float bc1, float bc2_sqrt, float scale, uint32_t key, int64_t idx0) {
    const float decay = 1.0f - lr * wd, step_size = lr / bc1, w1 = 1.0f - b1;
    float *restrict pf = (float *)p_; uint16_t *restrict ph = (uint16_t *)p_;
    const float *restrict gf = (const float *)g_; const uint16_t *restrict gh = (const uint16_t *)g_;
    if (!p_bf16 && g_bf16 && s) { BODY(pf[i], pf[i] = param, bf16_to_f32(gh[i]), s[i] = f32_to_bf16(param)) }
    else if (!p_bf16 && g_bf16) { BODY(pf[i], pf[i] = param, bf16_to_f32(gh[i]), (void)0) }
    else if (!p_bf16 && s)      { BODY(pf[i], pf[i] = param, gf[i], s[i] = f32_to_bf16(param)) }
    else if (!p_bf16)           { BODY(pf[i], pf[i] = param, gf[i], (void)0) }
    else if (g_bf16 && s)       { BODY(bf16_to_f32(ph[i]), ph[i] = s[i] = SR(i), bf16_to_f32(gh[i]), (void)0) }
    else if (g_bf16)            { BODY(bf16_to_f32(ph[i]), ph[i] = SR(i), bf16_to_f32(gh[i]), (void)0) }
    else if (s)                 { BODY(bf16_to_f32(ph[i]), ph[i] = s[i] = SR(i), gf[i], (void)0) }
    else                        { BODY(bf16_to_f32(ph[i]), ph[i] = SR(i), gf[i], (void)0) }
}

/* The same update in two passes, for an fp32 master with a bf16 stream copy: the first writes the
   moments and the stream copy the next forward fetches (24 bytes per parameter with a bf16 gradient,
   which may alias s), the second the master from the new moments (16 bytes), later. Each computes
   what adamw_piece does with the same operations in the same order, so the results are its own bit
   for bit (no contraction into fused multiply-adds: -ffp-contract=off). */
void adamw_stream_pass(const float *restrict pf, const void *g_, int g_bf16, float *restrict m,
                       float *restrict v, uint16_t *s, int64_t n, float lr, float b1, float b2, float eps,
                       float wd, float bc1, float bc2_sqrt, float scale) {
    const float decay = 1.0f - lr * wd, step_size = lr / bc1, w1 = 1.0f - b1;
    const float *gf = (const float *)g_; const uint16_t *gh = (const uint16_t *)g_;
    if (g_bf16) { BODY(pf[i], (void)0, bf16_to_f32(gh[i]), s[i] = f32_to_bf16(param)) }
    else        { BODY(pf[i], (void)0, gf[i], s[i] = f32_to_bf16(param)) }
}

void adamw_master_pass(float *restrict pf, const float *restrict m, const float *restrict v, int64_t n,
                       float lr, float eps, float wd, float bc1, float bc2_sqrt) {
    const float decay = 1.0f - lr * wd, step_size = lr / bc1;
    for (int64_t i = 0; i < n; i++) {
        float param = pf[i] * decay;
        float mi = m[i], vi = v[i];
        param -= step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
        pf[i] = param;
    }
}

/* ---- The compact state (megatrain_ray.engine.compact): 8-bit moments, bf16 master, stochastic rounding. */
#define QBLOCK 2048
static inline float bits_f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float code_mag(uint32_t c, int mb) {  /* code (no sign) -> magnitude / block scale */
    uint32_t e = (c >> mb) & 15u, mant = c & ((1u << mb) - 1u);
    return e ? bits_f(((e + 112u) << 23) | (mant << (23 - mb))) : 0.0f;
}
static inline uint32_t code_of(float r, uint32_t rnd, int mb) {  /* r in [0, 1] -> code, rounded stochastically */
    uint32_t u = f_bits(r) + (rnd & ((1u << (23 - mb)) - 1u));
    int32_t e = (int32_t)(u >> 23) - 112;
    if (e <= 0) return 0;
    if (e > 15) return 15u << mb;
    return ((uint32_t)e << mb) | ((u >> (23 - mb)) & ((1u << mb) - 1u));
}

/* One compact AdamW step on elements [0, n) of a piece that starts on a block boundary. p: bf16 master;
   g: gradient (bf16 when g_bf16, else fp32); qm, qv: codes of exp_avg and sqrt(exp_avg_sq); sm, sv: the
   piece's block scales; elements below decay_end decay by decay_a, the rest by decay_b; idx0: the
   piece's first element's index in its unit (for the random bits). */
#define CBODY(LOAD_G)                                                                       \
    for (int64_t j0 = 0; j0 < n; j0 += QBLOCK) {                                            \
        int nb = (int)(n - j0 < QBLOCK ? n - j0 : QBLOCK);                                  \
        float smo = sm[j0 / QBLOCK], svo = sv[j0 / QBLOCK];                                 \
        uint32_t mmax = 0, smax = 0;                                                        \
        for (int k = 0; k < nb; k++) {                                                      \
            int64_t i = j0 + k;                                                             \
            float grad = (LOAD_G) * scale;                                                  \
            uint32_t cm = qm[i];                                                            \
            float m0 = code_mag(cm & 0x7fu, 3) * smo; m0 = (cm & 0x80u) ? -m0 : m0;         \
            float s0 = code_mag(qv[i], 4) * svo, v0 = s0 * s0;                              \
            float param = bf16_to_f32(p[i]) * (i < decay_end ? decay_a : decay_b);          \
            float m1 = m0 + w1 * (grad - m0);                                               \
            float v1 = v0 * b2 + grad * grad * omb2;                                        \
            float s1 = sqrtf(v1);                                                           \
            param = param - step_size * m1 / (s1 / bc2_sqrt + eps);                         \
            uint32_t h = mix32((uint32_t)(idx0 + i) ^ key);                                 \
            p[i] = (uint16_t)((f_bits(param) + (h & 0xffffu)) >> 16);                       \
            bm[k] = m1; bs[k] = s1; bh[k] = h;                                              \
        }                                                                                   \
        for (int k = 0; k < nb; k++) {                                                      \
            uint32_t a = f_bits(bm[k]) & 0x7fffffffu, b = f_bits(bs[k]) & 0x7fffffffu;      \
            mmax = a > mmax ? a : mmax; smax = b > smax ? b : smax;                         \
        }                                                                                   \
        float smn = bits_f(mmax), svn = bits_f(smax);                                       \
        float im = smn > 0.0f ? 1.0f / smn : 0.0f, is = svn > 0.0f ? 1.0f / svn : 0.0f;     \
        sm[j0 / QBLOCK] = smn; sv[j0 / QBLOCK] = svn;                                       \
        for (int k = 0; k < nb; k++) {                                                      \
            int64_t i = j0 + k;                                                             \
            uint32_t h1 = bh[k];  /* the element's random bits, as the master's rounding took them */ \
            uint32_t h2 = mix32(h1 + 0x9e3779b9u), h3 = mix32(h2 + 0x9e3779b9u);            \
            uint32_t c = code_of(fabsf(bm[k]) * im, h2, 3);                                 \
            qm[i] = (uint8_t)(c | (bm[k] < 0.0f ? 0x80u : 0u));                             \
            qv[i] = (uint8_t)code_of(bs[k] * is, h3, 4);                                    \
        }                                                                                   \
    }

void compact_piece(uint16_t *restrict p, const void *g_, int g_bf16, uint8_t *restrict qm, uint8_t *restrict qv,
                   float *restrict sm, float *restrict sv, int64_t n, int64_t decay_end, float decay_a,
                   float decay_b, float w1, float b2, float omb2, float step_size, float bc2_sqrt, float eps,
                   float scale, uint32_t key, int64_t idx0) {
    float bm[QBLOCK], bs[QBLOCK];
    uint32_t bh[QBLOCK];
    const float *restrict gf = (const float *)g_; const uint16_t *restrict gh = (const uint16_t *)g_;
    if (g_bf16) { CBODY(bf16_to_f32(gh[i])) }
    else        { CBODY(gf[i]) }
}
"""

_FLAGS = (["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off"],
          ["-O3", "-fno-math-errno", "-ffp-contract=off"])
"""Compiler flags to try in turn (some compilers reject -march=native); -fno-math-errno lets the
loop with sqrtf vectorize; -ffp-contract=off keeps every multiply and add separately rounded (no
fused multiply-add), as torch's kernels do, so the compact kernel equals its torch reference bit for bit."""

_lock = threading.Lock()
_loaded: dict[str, object] = {}


def _build(directory: str) -> str | None:
    """Compile the kernel into ``directory`` (once per source and machine); returns the library path."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    key = hashlib.sha256((_SOURCE + repr(_FLAGS) + os.uname().machine + cc).encode()).hexdigest()[:16]
    lib = os.path.join(directory, f"adamw-{key}.so")
    if os.path.exists(lib):
        return lib
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        src, out = os.path.join(tmp, "adamw.c"), os.path.join(tmp, "adamw.so")
        with open(src, "w") as f:
            f.write(_SOURCE)
        for flags in _FLAGS:
            done = subprocess.run([cc, *flags, "-fPIC", "-shared", "-o", out, src], capture_output=True)
            if done.returncode == 0:
                os.replace(out, lib)  # atomic: concurrent builders leave one complete file
                return lib
    return None


def _library(directory: str | None):
    """The loaded library (built on first use), or None where it cannot be built or is turned off."""
    if os.environ.get("MEGATRAIN_NATIVE_ADAMW", "1") == "0":
        return None
    directory = directory or os.path.join(os.path.expanduser("~"), ".cache", "megatrain_ray")
    with _lock:
        if directory not in _loaded:
            try:
                lib = _build(directory)
            except OSError:
                lib = None
            _loaded[directory] = None if lib is None else ctypes.CDLL(lib)
        return _loaded[directory]


def kernel(directory: str | None = None):
    """The loaded ``adamw_piece`` function, or None where it cannot be built (then torch's kernels are used).

    MEGATRAIN_NATIVE_ADAMW=0 turns it off.
    """
    lib = _library(directory)
    if lib is None:
        return None
    fn = lib.adamw_piece
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_float] * 8 + [ctypes.c_uint32,
                                                                                             ctypes.c_int64]
    return fn


def split_kernels(directory: str | None = None):
    """The loaded (``adamw_stream_pass``, ``adamw_master_pass``) functions: the update of
    :func:`kernel` in two passes (see :func:`stream_pass`), or None as :func:`kernel`."""
    lib = _library(directory)
    if lib is None:
        return None
    first, second = lib.adamw_stream_pass, lib.adamw_master_pass
    first.restype = second.restype = None
    first.argtypes = ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int64]
                      + [ctypes.c_float] * 8)
    second.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_float] * 5
    return first, second


def compact_kernel(directory: str | None = None):
    """The loaded ``compact_piece`` function (see :mod:`megatrain_ray.engine.compact`), or None as :func:`kernel`."""
    lib = _library(directory)
    if lib is None:
        return None
    fn = lib.compact_piece
    fn.restype = None
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2
                   + [ctypes.c_float] * 9 + [ctypes.c_uint32, ctypes.c_int64])
    return fn


def _at(t: torch.Tensor | None, i: int) -> int | None:
    """The address of element ``i`` of contiguous ``t`` (None for None): what the kernels take."""
    return None if t is None else t.data_ptr() + i * t.element_size()


def _corrections(beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """AdamW's bias corrections at 1-based ``step``: (1 - beta1^step, sqrt(1 - beta2^step))."""
    return 1.0 - beta1 ** step, (1.0 - beta2 ** step) ** 0.5


def compact_piece(fn, master: torch.Tensor, grad: torch.Tensor, qm: torch.Tensor, qv: torch.Tensor,
                  sm: torch.Tensor, sv: torch.Tensor, a: int, b: int, decay_numel: int, c, key: int) -> None:
    """Elements [a, b) of one unit's compact step through ``fn`` (``a`` a multiple of the block size).

    master: [n] bf16, grad: [n] bf16/fp32, qm, qv: [n] uint8, sm, sv: [blocks] fp32, all contiguous;
    ``c``: the step's :class:`~megatrain_ray.engine.compact.StepConstants`; ``key``: its random key.
    """
    fn(_at(master, a), _at(grad, a), int(grad.dtype == torch.bfloat16), _at(qm, a), _at(qv, a), _at(sm, a // BLOCK),
       _at(sv, a // BLOCK), b - a, decay_numel - a, c.decay_a, c.decay_b, c.w1, c.b2, c.one_minus_b2, c.step_size,
       c.bc2_sqrt, c.eps, c.scale, key, a)


def supports(master: torch.Tensor, grad: torch.Tensor, stream: torch.Tensor | None) -> bool:
    """Whether the kernel handles these dtypes (fp32/bf16 master and gradient, bf16 stream) and layouts."""
    ok = {torch.float32, torch.bfloat16}
    return (master.dtype in ok and grad.dtype in ok and (stream is None or stream.dtype == torch.bfloat16)
            and all(t is None or t.is_contiguous() and t.device.type == "cpu" for t in (master, grad, stream)))


def piece(fn, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
          stream: torch.Tensor | None, a: int, b: int, lr: float, beta1: float, beta2: float, eps: float,
          weight_decay: float, step: int, scale: float, key: int = 0) -> None:
    """Elements [a, b) of one unit's AdamW step through the kernel ``fn`` (all tensors [n], contiguous);
    a bf16 master is rounded stochastically with the bits of ``key`` (:func:`~megatrain_ray.engine.compact.rng_key`)."""
    fn(_at(master, a), int(master.dtype == torch.bfloat16), _at(grad, a), int(grad.dtype == torch.bfloat16),
       _at(exp_avg, a), _at(exp_avg_sq, a), _at(stream, a), b - a, lr, beta1, beta2, eps, weight_decay,
       *_corrections(beta1, beta2, step), scale, key, a)


def stream_pass(fn, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                stream: torch.Tensor, a: int, b: int, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, step: int, scale: float) -> None:
    """The first pass of elements [a, b) of :func:`piece` (fp32 ``master``, bf16 ``stream``; ``grad``
    may alias ``stream``): the moments and the stream copy are updated, the master is only read."""
    fn(_at(master, a), _at(grad, a), int(grad.dtype == torch.bfloat16), _at(exp_avg, a), _at(exp_avg_sq, a),
       _at(stream, a), b - a, lr, beta1, beta2, eps, weight_decay, *_corrections(beta1, beta2, step), scale)


def master_pass(fn, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, a: int, b: int,
                lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> None:
    """The second pass of elements [a, b): the fp32 ``master`` from the moments the first pass wrote;
    together bit for bit :func:`piece`'s update."""
    fn(_at(master, a), _at(exp_avg, a), _at(exp_avg_sq, a), b - a, lr, eps, weight_decay,
       *_corrections(beta1, beta2, step))
