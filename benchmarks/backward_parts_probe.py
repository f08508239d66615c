"""Where a dense layer's backward and the host's update of it spend their time, on one GPU box.

1. **The GPU** (one compiled Qwen2.5-7B layer, 4 micro-batches of [16, 1024] tokens, as the compute
   worker runs it): the CUDA kernels of a kept layer's backward and of a recomputed layer's
   recompute + backward, by kind (GEMMs, attention, the compiled elementwise kernels, the weight
   gradients added into the fp32 buffer by :mod:`~megatrain_ray.engine.compute.grad_sum`, the
   rest), each kind's time and the GEMMs' rate; then each weight's gradient of one micro-batch,
   side by side: a bf16 GEMM and torch's ``add_`` into an fp32 buffer, the GEMM alone, and one GEMM
   that accumulates into the fp32 buffer itself (``torch.addmm(..., out_dtype=torch.float32)``),
   with the two sums' largest difference from a float64 one.
2. **The host** (one layer's 233 M parameters): the AdamW kernels of the gradient sink on 8 to 16
   threads — the one-pass update (28 bytes a parameter), the split update's first pass (24: the
   moments and the stream copy, what the next forward waits on) and second pass (16: the master) —
   and a first pass that writes only a stream copy into a separate buffer (16 bytes), what a split
   that kept the gradient until its second pass would make the forward wait on.

    python3 benchmarks/backward_parts_probe.py OUT          # on a CUDA GPU box, from the repository root (~1 min)
    python3 benchmarks/backward_parts_probe.py OUT --smoke  # the CPU, a tiny layer (host part only)

Writes OUT/backward_parts.json and prints the tables.
"""

import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.probes import cuda_ms  # noqa: E402
from megatrain_ray.config import OptimConfig  # noqa: E402
from megatrain_ray.engine.optim import AdamWRunner, run_pieces  # noqa: E402
from megatrain_ray.model.transformer import PROJECTION_GROUPS  # noqa: E402

KINDS = (("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
         ("attention", ("flash", "fmha", "sdpa", "attention")),
         ("compiled elementwise", ("triton",)), ("aten elementwise (the fp32 accumulate)", ("elementwise", "add_into")))


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(key in low for key in keys)), "other")


def kernel_table(prof) -> dict:
    """CUDA kernel time by kind (ms) and the ten longest kernels, from a torch.profiler run."""
    by_kind, top = {}, []
    for e in prof.key_averages():
        ms = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) / 1e3
        if ms <= 0 or e.key.startswith(("aten::", "cuda", "Memcpy", "Memset")) or "ProfilerStep" in e.key:
            continue
        k = kind_of(e.key)
        by_kind[k] = by_kind.get(k, 0.0) + ms
        top.append((ms, e.count, k, e.key[:90]))
    return {"by_kind_ms": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top": [dict(ms=round(ms, 3), calls=c, kind=k, name=n) for ms, c, k, n in sorted(top, reverse=True)[:10]]}


def gpu_part() -> dict:
    from torch.profiler import ProfilerActivity, profile

    from megatrain_ray.engine.compute.activations import kept_backward, layer_forward_kept
    from megatrain_ray.engine.compute.sequence import CompiledLayer, LayerRunner, layer_backward
    from megatrain_ray.model import transformer as M
    from megatrain_ray.model.layout import LayerTemplate
    from megatrain_ray.model.presets import preset_model

    cfg = preset_model("7b", layers=1)
    t = LayerTemplate.build(cfg, "layers.0")
    flat = (torch.randn(t.numel, device="cuda") * 0.02).to(torch.bfloat16)
    grad = torch.zeros(t.numel, device="cuda")
    xs = [torch.randn(16, 1024, cfg.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    ctx = [(M.rope_cache(cfg, 1024, torch.device("cuda"), torch.bfloat16), None)] * len(xs)
    tokens = 4 * 16 * 1024
    from torch._inductor import config as inductor_config

    runner = LayerRunner(wrap=lambda fn: CompiledLayer(threads=inductor_config.compile_threads, fn=fn))

    def kept_graph():
        return layer_forward_kept(runner.layer, t, flat, xs, ctx, cfg)

    def kept_bwd(graph):
        kept_backward(graph, t.bind(grad, fused=True), [torch.ones_like(x) for x in xs])

    def recompute_bwd():
        layer_backward(runner, t.bind(flat, fused=True), t.bind(grad, fused=True), xs,
                       [torch.ones_like(x) for x in xs], ctx, cfg)

    kept_bwd(kept_graph())  # compiles
    recompute_bwd()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": tokens}
    flops_fwd = 2 * t.param_count * tokens
    for name, setup, run, flops in (("kept backward", kept_graph, kept_bwd, 2 * flops_fwd),
                                    ("recompute + backward", lambda: None, lambda _: recompute_bwd(), None)):
        times = []
        for _ in range(3):
            state = setup()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(state)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        state = setup()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(state)
            torch.cuda.synchronize()
        row = {"ms": round(statistics.median(times), 2), **kernel_table(prof)}
        if flops:
            gemm_ms = row["by_kind_ms"].get("GEMM", 0.0)
            row["gemm_tflops"] = round(flops / (gemm_ms / 1e3) / 1e12, 1) if gemm_ms else None
        out[name] = row
        del state
    out["weight gradients"] = weight_gradient_rows(t, tokens)
    torch.cuda.empty_cache()
    return out


def weight_gradient_rows(t, tokens: int) -> list[dict]:
    """Each fused weight's gradient for one micro-batch (a quarter of ``tokens``) added into an fp32
    buffer: bf16 GEMM + add, against one GEMM accumulating in fp32 (where this torch has it)."""
    rows, m = [], tokens // 4
    views = t.bind(torch.empty(t.numel, device="meta"), fused=True)
    parts = {m for group, members in PROJECTION_GROUPS.items() if f"{group}.weight" in views for m in members}
    shapes = {name: tuple(w.shape) for name, w in views.items()  # the GEMMs the backward runs: fused where fused
              if name.endswith(".weight") and w.dim() == 2 and name.removesuffix(".weight") not in parts}
    for name, (n_out, n_in) in shapes.items():
        dy = torch.randn(m, n_out, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, n_in, device="cuda", dtype=torch.bfloat16)
        acc = torch.zeros(n_out, n_in, device="cuda")
        row = {"weight": name, "shape": [n_out, n_in], "tokens": m,
               "gemm_then_add_ms": round(cuda_ms(lambda: acc.add_(dy.t() @ x), reps=10), 3),
               "gemm_bf16_only_ms": round(cuda_ms(lambda: dy.t() @ x, reps=10), 3)}
        try:
            fused = torch.zeros_like(acc)
            row["gemm_accumulating_fp32_ms"] = round(cuda_ms(
                lambda: torch.addmm(fused, dy.t(), x, out_dtype=torch.float32, out=fused), reps=10), 3)
            ref = 2 * (dy.t().double() @ x.double())  # two micro-batches of the same gradient, in fp64
            one = torch.zeros_like(acc)
            acc.zero_()
            for _ in range(2):
                acc.add_(dy.t() @ x)
                torch.addmm(one, dy.t(), x, out_dtype=torch.float32, out=one)
            scale = ref.abs().max().item()
            row["max_err_vs_fp64_gemm_then_add"] = (acc - ref).abs().max().item() / scale
            row["max_err_vs_fp64_accumulating"] = (one - ref).abs().max().item() / scale
        except (RuntimeError, TypeError) as e:
            row["gemm_accumulating_fp32_ms"] = f"unavailable: {str(e).splitlines()[0][:120]}"
        rows.append(row)
        del dy, x, acc
    return rows


LEAN_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
static inline float bf(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t tobf(float f) {
    uint32_t u; memcpy(&u, &f, 4); u += 0x7fffu + ((u >> 16) & 1u); return (uint16_t)(u >> 16);
}
void lean_pass(const float *restrict p, const uint16_t *restrict g, const float *restrict m, const float *restrict v,
               uint16_t *restrict s, int64_t n, float lr, float b1, float b2, float eps, float wd, float bc1,
               float bc2_sqrt, float scale) {
    const float decay = 1.0f - lr * wd, step_size = lr / bc1, w1 = 1.0f - b1;
    for (int64_t i = 0; i < n; i++) {
        float grad = bf(g[i]) * scale, param = p[i] * decay;
        float mi = m[i] + w1 * (grad - m[i]), vi = v[i] * b2 + grad * grad * (1.0f - b2);
        s[i] = tobf(param - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps));
    }
}
"""


def lean_kernel():
    """The 16-byte first pass (reads the master, gradient and moments, writes a stream copy only)."""
    d = tempfile.mkdtemp()
    src, lib = os.path.join(d, "lean.c"), os.path.join(d, "lean.so")
    with open(src, "w") as f:
        f.write(LEAN_SOURCE)
    subprocess.run(["cc", "-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC",
                    src, "-o", lib], check=True)
    fn = ctypes.CDLL(lib).lean_pass
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_float] * 8
    return fn


def host_part(numel: int) -> dict:
    cpus = sorted(os.sched_getaffinity(0))
    cfg = OptimConfig()
    p, m, v = torch.randn(numel), torch.rand(numel) * 1e-3, torch.rand(numel) * 1e-6
    g, s, ring = torch.randn(numel).to(torch.bfloat16), torch.empty(numel, dtype=torch.bfloat16), torch.empty(
        numel, dtype=torch.bfloat16)
    lean = lean_kernel()
    rows = []
    counts = sorted({c for c in (8, 12, 14, len(cpus)) if c <= len(cpus)})
    for n in counts:
        os.sched_setaffinity(0, cpus[len(cpus) - n:])  # the last n CPUs: the run leaves the first to the GPU's worker
        runner = AdamWRunner(n)
        if runner.split is None:
            return {"error": "the native AdamW kernel could not be built"}
        chunk = 1 << 20
        pieces = [(a, min(numel, a + chunk)) for a in range(0, numel, chunk)]

        def lean_pass():
            run_pieces(runner._pool, n, len(pieces), lambda i: lean(
                p.data_ptr() + 4 * pieces[i][0], g.data_ptr() + 2 * pieces[i][0], m.data_ptr() + 4 * pieces[i][0],
                v.data_ptr() + 4 * pieces[i][0], ring.data_ptr() + 2 * pieces[i][0], pieces[i][1] - pieces[i][0],
                1e-4, 0.9, 0.95, 1e-8, 0.1, 0.1, 0.2236, 0.5))

        calls = {"one pass (28 B)": lambda: runner.update(p, g, m, v, s, numel, 2, 1e-4, cfg, 0.5),
                 "first pass (24 B)": lambda: runner.update_stream(p, g, m, v, s, numel, 2, 1e-4, cfg, 0.5),
                 "second pass (16 B)": lambda: runner.update_master(p, m, v, numel, 2, 1e-4, cfg),
                 "lean first pass (16 B)": lean_pass}
        row = {"threads": n, "cpus": f"{cpus[len(cpus) - n]}-{cpus[-1]}"}
        for name, fn in calls.items():
            fn()
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            row[name] = round(statistics.median(times) * 1e3, 2)
        rows.append(row)
        runner.close()
    os.sched_setaffinity(0, cpus)
    return {"numel": numel, "ms": rows}


def main() -> None:
    out_dir = sys.argv[1]
    smoke = "--smoke" in sys.argv
    os.makedirs(out_dir, exist_ok=True)
    result = {}
    if not smoke and torch.cuda.is_available():
        result["gpu"] = gpu_part()
        for part in ("kept backward", "recompute + backward"):
            r = result["gpu"][part]
            print(f"{part}: {r['ms']} ms; by kind (ms): {r['by_kind_ms']}; GEMM TFLOP/s {r.get('gemm_tflops')}")
            for k in r["top"]:
                print(f"    {k['ms']:9.3f} ms  x{k['calls']:<3d} {k['kind']:22s} {k['name']}")
        for r in result["gpu"]["weight gradients"]:
            print("   ", json.dumps(r))
    result["host"] = host_part(2_000_000 if smoke else 233_057_792)
    for r in result["host"].get("ms", []):
        print("host", json.dumps(r))
    with open(os.path.join(out_dir, "backward_parts.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
