"""Which scaled-dot-product attention backend is fastest on this GPU, at the 7B shape's heads.

Times causal grouped-query attention (28 query heads, 4 key/value heads, head size 128: the
Qwen2.5-7B shape) forward and forward + backward in bf16, for each backend torch offers through
``torch.nn.attention.sdpa_kernel`` (flash, cuDNN, memory-efficient) and FlexAttention with a causal
block mask, at the benchmark's shape (16 sequences of 1,024) and one long sequence of each length
given. Prints one row per (shape, backend): ms forward, ms forward + backward, TFLOP/s of the
forward + backward (causal FLOPs: 4·S²·d·heads / 2 forward, 2.5x that backward) and peak memory.

    python3 benchmarks/attn_probe.py --out DIR [--long 65536,131072,524288]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, KV_HEADS, D = 28, 4, 128


def flex_fn():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v):
        s = q.shape[-2]
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, s, s, device=q.device)
        return compiled(q, k, v, block_mask=mask, enable_gqa=True)
    return run


def sdpa_fn(backend):
    def run(q, k, v):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return run


def timed(fn, reps):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def probe(name, run, b, s, reps):
    q = torch.randn(b, HEADS, s, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, KV_HEADS, s, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, KV_HEADS, s, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(b, HEADS, s, D, device="cuda", dtype=torch.bfloat16)

    def fwd():
        with torch.no_grad():
            run(q, k, v)

    def fwd_bwd():
        out = run(q, k, v)
        torch.autograd.grad(out, (q, k, v), do)

    try:
        fwd_bwd()  # warm-up (and compile)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        f_ms = timed(fwd, reps)
        fb_ms = timed(fwd_bwd, reps)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    except Exception as e:  # a backend that does not take this shape: say why, go on
        return {"shape": f"{b}x{s}", "backend": name, "error": f"{type(e).__name__}: {str(e)[:120]}"}
    flops = 4 * s * s * D * HEADS / 2 * b * 3.5
    return {"shape": f"{b}x{s}", "backend": name, "fwd_ms": f_ms, "fwd_bwd_ms": fb_ms,
            "tflops": flops / (fb_ms / 1e3) / 1e12, "extra_peak_gib": peak}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--long", default="65536,131072,524288")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    backends = {"flash": sdpa_fn(SDPBackend.FLASH_ATTENTION), "cudnn": sdpa_fn(SDPBackend.CUDNN_ATTENTION),
                "efficient": sdpa_fn(SDPBackend.EFFICIENT_ATTENTION), "flex": flex_fn()}
    shapes = [(16, 1024, 5)] + [(1, int(s), 3 if int(s) <= 131072 else 1) for s in args.long.split(",")]
    rows = []
    for b, s, reps in shapes:
        for name, run in backends.items():
            rows.append(probe(name, run, b, s, reps))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "attn_probe.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"{'shape':>10} {'backend':>9} {'fwd ms':>9} {'f+b ms':>9} {'TFLOP/s':>8} {'peak GiB':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:>10} {r['backend']:>9}  {r['error'][:60]}")
        else:
            print(f"{r['shape']:>10} {r['backend']:>9} {r['fwd_ms']:9.1f} {r['fwd_bwd_ms']:9.1f} {r['tflops']:8.0f} "
                  f"{r['extra_peak_gib']:8.2f}")


if __name__ == "__main__":
    main()
