"""The compact AdamW step's rate (optim.state 8bit) on this CPU: parameters per second of the native kernel
on N threads, and per core; the torch reference's on one unit for comparison. With ``--device cuda``, on
the GPU instead: the fused kernel (engine/compact_fused.py) and the torch reference, as the device
update runs them. Prints a table last.

    python benchmarks/compact_rate.py --threads 16 [--numel 268435456] [--out DIR]
    python benchmarks/compact_rate.py --device cuda [--numel 268435456] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_ray.config import OptimConfig  # noqa: E402
from megatrain_ray.engine import adamw_native, compact, compact_fused, optim  # noqa: E402


def rate(threads: int, numel: int, repeats: int = 3, native: bool = True) -> tuple[float, float]:
    """(parameters per second of wall time, per CPU-second) of AdamWRunner.update_compact on one flat unit
    of ``numel`` elements; the second is the per-core rate even on a machine shared with other work."""
    gen = torch.Generator().manual_seed(0)
    master = (torch.randn(numel, generator=gen) * 0.02).to(torch.bfloat16)
    grad = torch.randn(numel, generator=gen).to(torch.bfloat16)
    qm, qv = torch.zeros(numel, dtype=torch.uint8), torch.zeros(numel, dtype=torch.uint8)
    sm, sv = torch.zeros(compact.num_blocks(numel)), torch.zeros(compact.num_blocks(numel))
    runner = optim.AdamWRunner(threads, native=native)
    cfg = OptimConfig(lr=1e-4, weight_decay=0.1)
    best, best_cpu = float("inf"), float("inf")
    for step in range(1, repeats + 2):
        start, cpu = time.perf_counter(), time.process_time()
        runner.update_compact(master, grad, qm, qv, sm, sv, None, numel, 1, step, cfg.lr, cfg, 0.5)
        if step > 1:  # the first touches the pages
            best, best_cpu = min(best, time.perf_counter() - start), min(best_cpu, time.process_time() - cpu)
    runner.close()
    return numel / best, numel / best_cpu


def gpu_rate(numel: int, fused: bool, repeats: int = 5) -> float:
    """Parameters per second of one compact step on ``numel`` elements on the GPU: the fused kernel, or
    step_reference in chunks of the device update's size (its temporaries bound the chunk)."""
    from megatrain_ray.engine.compute.device_updates import COMPACT_CHUNK
    gen = torch.Generator().manual_seed(0)
    master = (torch.randn(numel, generator=gen) * 0.02).to(torch.bfloat16).cuda()
    grad = torch.randn(numel, generator=gen).cuda()
    qm, qv = (torch.zeros(numel, dtype=torch.uint8, device="cuda") for _ in range(2))
    sm, sv = (torch.zeros(compact.num_blocks(numel), device="cuda") for _ in range(2))
    best = float("inf")
    for step in range(1, repeats + 2):
        c = compact.StepConstants.of(step, 1e-4, 0.9, 0.999, 1e-8, 0.1, 0.0, 0.5)
        torch.cuda.synchronize()
        start = time.perf_counter()
        if fused:
            compact_fused.step(master, grad, qm, qv, sm, sv, numel, c, compact.rng_key(step, 0))
        else:
            for lo in range(0, numel, COMPACT_CHUNK):
                hi = min(numel, lo + COMPACT_CHUNK)
                blocks = slice(lo // compact.BLOCK, compact.num_blocks(hi))
                compact.step_reference(master[lo:hi], grad[lo:hi], qm[lo:hi], qv[lo:hi], sm[blocks], sv[blocks],
                                       numel - lo, c, compact.rng_key(step, 0), lo)
        torch.cuda.synchronize()
        if step > 1:  # the first compiles the kernel
            best = min(best, time.perf_counter() - start)
    return numel / best


def main_gpu(numel: int, out: str | None) -> int:
    rows = {"fused": gpu_rate(numel, True) if compact_fused.available(torch.device("cuda")) else float("nan"),
            "torch_reference": gpu_rate(numel, False, repeats=2)}
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "compact_rate_gpu.json"), "w") as f:
            json.dump({"numel": numel, "gpu": torch.cuda.get_device_name(), **rows}, f, indent=1)
    print(f"{'what (' + torch.cuda.get_device_name() + ')':<40}{'G params/s':>12}")
    for key, label in (("fused", "fused kernel"), ("torch_reference", "torch reference (step_reference)")):
        print(f"{label:<40}{rows[key] / 1e9:>12.2f}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--numel", type=int, default=1 << 28)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        return main_gpu(args.numel, args.out)
    if adamw_native.compact_kernel() is None:
        print("no C compiler: the native kernel cannot be built")
        return 1
    rows = {"native_all": rate(args.threads, args.numel), "native_1": rate(1, min(args.numel, 1 << 26)),
            "torch_reference_1": rate(1, 1 << 20, repeats=1, native=False)}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "compact_rate.json"), "w") as f:
            json.dump({"threads": args.threads, "numel": args.numel, **rows}, f, indent=1)
    print(f"{'what':<34}{'G params/s':>12}{'per CPU-s':>12}")
    for key, label in (("native_all", f"native, {args.threads} threads"), ("native_1", "native, 1 thread"),
                       ("torch_reference_1", "torch reference, 1 thread")):
        print(f"{label:<34}{rows[key][0] / 1e9:>12.4f}{rows[key][1] / 1e9:>12.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
