"""Where does a LoRA step's time go, one decoder layer at a time?

One decoder layer of a preset's shape with its adapters (lora.rank, the default target modules),
its base frozen, run as the compute worker runs it: the forward of every micro-batch without a
graph, then the recompute + backward of each (:func:`~megatrain_ray.engine.compute.sequence.layer_backward`,
the adapters' gradients only), compiled as the worker compiles the layer. Prints, for the forward
and the backward:

- ms measured, and the GEMM floor at --gemm-tflops (the forward: 2 FLOPs per matmul parameter and
  token, the adapters' 2 per parameter; the backward: the recompute up to the down projection, the
  input gradients' 2 per matmul parameter, the adapters' 4);
- the CUDA time by kind of kernel from the profiler (GEMMs, attention, fused elementwise kernels,
  copies, the rest), the adapters' rank-r GEMMs among them (their ops' input shapes), and the top
  kernels by time;
- a layer's share of a step of --layers layers: layers x (forward + backward).

  python3 benchmarks/lora_layer_probe.py --preset 32b --out OUT                       # one GPU
  python3 benchmarks/lora_layer_probe.py --preset tiny --device cpu --micro-batches 2 --seq-len 64 --out OUT  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import torch

KINDS = (("attention", re.compile(r"flash|fmha|attention|cudnn|sdpa", re.I)),
         ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm90|sm80|matmul|addmm|\bmm\b", re.I)),
         ("fused elementwise", re.compile(r"^triton_|elementwise|vectorized|reduce", re.I)),
         ("copies", re.compile(r"memcpy|memset|copy", re.I)))
"""(kind, pattern on the kernel's name) in the order a kernel is classified; the rest is 'other'."""
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm")
"""The ops whose input shapes tell an adapter's rank-r GEMM from the base's."""


def kind_of(name: str) -> str:
    """A kernel's kind (see :data:`KINDS`)."""
    return next((k for k, pattern in KINDS if pattern.search(name)), "other")


def probe(preset: str, seq_len: int, micro_batch_size: int, micro_batches: int, rank: int, device: str,
          compile_layer: bool, reps: int) -> dict:
    from megatrain_ray.bench import base_sections, bench_config
    from megatrain_ray.engine.compute.sequence import CompiledLayer, LayerRunner, layer_backward
    from megatrain_ray.model import transformer as M
    from megatrain_ray.model.layout import LayerTemplate
    from megatrain_ray.model.lora import AdapterLayout

    tokens = seq_len * micro_batch_size * micro_batches
    cfg = bench_config(base_sections(preset, None, None, 1), tokens, seq_len, micro_batches, 1, None,
                       [f"lora.rank={rank}", f"lora.alpha={2 * rank}", f"compute.device={device}"])
    mc, dtype, dev = cfg.model, torch.bfloat16 if device == "cuda" else torch.float32, torch.device(device)
    base_t = LayerTemplate.build(mc, "layers.0")
    adapters = AdapterLayout.build(mc, cfg.lora)
    ad_t = adapters.template("layers.0")
    flat = (torch.randn(base_t.numel, device=dev) * 0.02).to(dtype)
    ad_flat = (torch.randn(ad_t.numel, device=dev) * 0.02).to(dtype)
    ad_grad = torch.zeros(ad_t.numel, device=dev)
    params = {**base_t.bind(flat, fused=True), **adapters.bind("layers.0", ad_flat)}
    grads = ad_t.bind(ad_grad)
    xs = [torch.randn(micro_batch_size, seq_len, mc.hidden_size, device=dev, dtype=dtype) for _ in range(micro_batches)]
    rope = M.rope_cache(mc, seq_len, dev, dtype)
    wrap = (lambda fn: CompiledLayer(threads=1, fn=fn)) if compile_layer else None
    runner = LayerRunner(0, wrap)

    def fwd():
        with torch.no_grad():
            for x in xs:
                runner.layer(params, x, rope, mc)

    def bwd():
        layer_backward(runner, params, grads, xs, [torch.ones_like(x) for x in xs], [(rope, None)] * len(xs), mc)

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    start = time.perf_counter()
    fwd(), bwd(), sync()
    out = {"preset": preset, "tokens": tokens, "rank": rank, "device": device, "compile_s": time.perf_counter() - start}
    for name, fn in (("fwd", fwd), ("bwd", bwd)):
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        out[f"{name}_ms"] = (time.perf_counter() - t0) / reps * 1e3
    matmul = sum(n for n, _ in _matmuls(base_t))
    down = mc.hidden_size * mc.intermediate_size
    attn = sum(n for n, name in _matmuls(base_t) if "self_attn" in name)
    ad = ad_t.param_count
    out["fwd_flops"] = tokens * (2 * matmul + 2 * ad)
    out["bwd_flops"] = tokens * (2 * (attn + (matmul - attn - down)) + 2 * matmul + 2 * ad + 4 * ad)
    if device == "cuda":
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        for name, fn in (("fwd", fwd), ("bwd", bwd)):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
                fn()
                sync()
            by_kind, top, adapter_ms = {}, [], 0.0
            for e in prof.key_averages(group_by_input_shape=True):
                us = getattr(e, "device_time_total", 0.0)
                if e.device_type == DeviceType.CUDA and us > 0:  # a kernel
                    kind = kind_of(e.key)
                    by_kind[kind] = by_kind.get(kind, 0.0) + us / 1e3
                    top.append((us / 1e3, e.count, e.key[:90]))
                elif e.key in GEMM_OPS and _is_rank_r(e, rank):  # an adapter's GEMM (its kernels counted above)
                    adapter_ms += us / 1e3
            out[f"{name}_by_kind_ms"] = dict(sorted(by_kind.items(), key=lambda kv: -kv[1]))
            out[f"{name}_adapter_gemm_ms"] = adapter_ms
            out[f"{name}_top"] = [list(t) for t in sorted(top, reverse=True)[:12]]
    return out


def _matmuls(t) -> list[tuple[int, str]]:
    """(parameters, name) of the layer's matrices (its norms' vectors left out)."""
    return [(shape[0] * shape[1] if len(shape) == 2 else shape[0] * shape[1] * shape[2], name)
            for name, shape, _ in t.params if len(shape) >= 2]


def _is_rank_r(event, rank: int) -> bool:
    """Whether a GEMM event is an adapter's: its input shapes, where recorded, have a dimension of ``rank``."""
    shapes = getattr(event, "input_shapes", None) or []
    return any(rank in s for s in shapes if isinstance(s, (list, tuple)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="32b")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=16)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=64, help="layers of the step the per-layer times are scaled to")
    ap.add_argument("--gemm-tflops", type=float, default=790.0, help="the GEMM rate the floors are at")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--eager", action="store_true", help="the layer not compiled")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True, help="folder for lora-layer-<preset>.json")
    args = ap.parse_args()
    r = probe(args.preset, args.seq_len, args.micro_batch_size, args.micro_batches, args.rank, args.device,
              not args.eager, args.reps)
    for name in ("fwd", "bwd"):
        floor = r[f"{name}_flops"] / (args.gemm_tflops * 1e12) * 1e3
        print(f"{name}: {r[f'{name}_ms']:.1f} ms for {r['tokens']:,} tokens; GEMM floor {floor:.1f} ms at "
              f"{args.gemm_tflops:.0f} TFLOP/s ({r[f'{name}_ms'] / floor:.2f}x)", flush=True)
        for kind, ms in r.get(f"{name}_by_kind_ms", {}).items():
            print(f"  {kind}: {ms:.1f} ms")
        if f"{name}_adapter_gemm_ms" in r:
            print(f"  (of the GEMMs, the adapters' rank-{args.rank} ones: {r[f'{name}_adapter_gemm_ms']:.1f} ms)")
        for ms, count, key in r.get(f"{name}_top", []):
            print(f"    {ms:8.2f} ms  x{count:<4} {key}")
    step = args.layers * (r["fwd_ms"] + r["bwd_ms"]) / 1e3
    floor = args.layers * (r["fwd_flops"] + r["bwd_flops"]) / (args.gemm_tflops * 1e12)
    print(f"{args.layers} layers: {step:.2f} s of layer work a step; their GEMM floor {floor:.2f} s", flush=True)
    r.update(layers=args.layers, layers_s=step, layers_floor_s=floor, gemm_tflops=args.gemm_tflops)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"lora-layer-{args.preset}.json"), "w") as f:
        json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
