"""A one-pass AdamW kernel in C for the host update, built on first use with the system C compiler.

The update of one unit reads the gradient (bf16 or fp32, scaled by the clipping factor), the
master weights and both moments, and writes the master, the moments and the bf16 stream copy, in
a single pass over memory: 28 bytes per parameter with fp32 master and bf16 gradient, which is
what bounds AdamW on a CPU. Doing the same with torch's kernels takes three passes (upcast,
fused AdamW, downcast). The arithmetic follows ``torch._fused_adamw_`` (decoupled weight decay,
``lerp`` for the first moment, bias corrections as scalars), in fp32.

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

/* AdamW on elements [0, n) of one piece. p: master (fp32 when p_bf16 == 0, else bf16); g: gradient
   (bf16 when g_bf16, else fp32); m, v: fp32 moments; s: bf16 stream copy to refresh, or NULL. */
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
                 float bc1, float bc2_sqrt, float scale) {
    const float decay = 1.0f - lr * wd, step_size = lr / bc1, w1 = 1.0f - b1;
    float *restrict pf = (float *)p_; uint16_t *restrict ph = (uint16_t *)p_;
    const float *restrict gf = (const float *)g_; const uint16_t *restrict gh = (const uint16_t *)g_;
    if (!p_bf16 && g_bf16 && s) { BODY(pf[i], pf[i] = param, bf16_to_f32(gh[i]), s[i] = f32_to_bf16(param)) }
    else if (!p_bf16 && g_bf16) { BODY(pf[i], pf[i] = param, bf16_to_f32(gh[i]), (void)0) }
    else if (!p_bf16 && s)      { BODY(pf[i], pf[i] = param, gf[i], s[i] = f32_to_bf16(param)) }
    else if (!p_bf16)           { BODY(pf[i], pf[i] = param, gf[i], (void)0) }
    else if (g_bf16 && s)       { BODY(bf16_to_f32(ph[i]), ph[i] = s[i] = f32_to_bf16(param), bf16_to_f32(gh[i]), (void)0) }
    else if (g_bf16)            { BODY(bf16_to_f32(ph[i]), ph[i] = f32_to_bf16(param), bf16_to_f32(gh[i]), (void)0) }
    else if (s)                 { BODY(bf16_to_f32(ph[i]), ph[i] = s[i] = f32_to_bf16(param), gf[i], (void)0) }
    else                        { BODY(bf16_to_f32(ph[i]), ph[i] = f32_to_bf16(param), gf[i], (void)0) }
}
"""

_FLAGS = (["-O3", "-march=native", "-fno-math-errno"], ["-O3", "-fno-math-errno"])
"""Compiler flags to try in turn (some compilers reject -march=native); -fno-math-errno lets the
loop with sqrtf vectorize."""

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


def kernel(directory: str | None = None):
    """The loaded ``adamw_piece`` function, or None where it cannot be built (then torch's kernels are used).

    MEGATRAIN_NATIVE_ADAMW=0 turns it off.
    """
    if os.environ.get("MEGATRAIN_NATIVE_ADAMW", "1") == "0":
        return None
    directory = directory or os.path.join(os.path.expanduser("~"), ".cache", "megatrain_ray")
    with _lock:
        if directory not in _loaded:
            fn = None
            try:
                lib = _build(directory)
            except OSError:
                lib = None
            if lib is not None:
                fn = ctypes.CDLL(lib).adamw_piece
                fn.restype = None
                fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_float] * 8
            _loaded[directory] = fn
        return _loaded[directory]


def supports(master: torch.Tensor, grad: torch.Tensor, stream: torch.Tensor | None) -> bool:
    """Whether the kernel handles these dtypes (fp32/bf16 master and gradient, bf16 stream) and layouts."""
    ok = {torch.float32, torch.bfloat16}
    return (master.dtype in ok and grad.dtype in ok and (stream is None or stream.dtype == torch.bfloat16)
            and all(t is None or t.is_contiguous() and t.device.type == "cpu" for t in (master, grad, stream)))


def piece(fn, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
          stream: torch.Tensor | None, a: int, b: int, lr: float, beta1: float, beta2: float, eps: float,
          weight_decay: float, step: int, scale: float) -> None:
    """Elements [a, b) of one unit's AdamW step through the kernel ``fn`` (all tensors [n], contiguous)."""
    def at(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr() + a * t.element_size()

    fn(at(master), int(master.dtype == torch.bfloat16), at(grad), int(grad.dtype == torch.bfloat16), at(exp_avg),
       at(exp_avg_sq), at(stream), b - a, lr, beta1, beta2, eps, weight_decay, 1.0 - beta1 ** step,
       (1.0 - beta2 ** step) ** 0.5, scale)
