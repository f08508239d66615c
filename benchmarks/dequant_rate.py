"""Does a quantized base's dequantization keep up with the link its bytes cross?

One decoder layer of each shape asked, quantized as the host store holds it (lora.base_format), its
block copied once into a device slot, then dequantized into the compute dtype (bf16) by the compute
worker's own code (:class:`~megatrain_ray.engine.store.quantized.DeviceDequant`), against the copy of
the same block from pinned host memory into that slot, timed in turn in the same run:

- dequantize: milliseconds per layer, and GB/s read (the block) + written (2 bytes a parameter);
- link: milliseconds per copy of the block, and GB/s;
- ratio: dequantization's time over the copy's. Under 1, a layer is dequantized before the next
  one's bytes have crossed (each layer is fetched, so dequantized, twice a step).

Prints one line per shape and format and writes OUT/dequant-rate.json.
  python3 benchmarks/dequant_rate.py --out OUT                                     # one GPU, the four default cases
  python3 benchmarks/dequant_rate.py --case small-moe:mxfp4 --device cpu --out OUT  # the CPU (smoke)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from megatrain_ray.engine.store.quantized import DeviceDequant, QuantizedBase
from megatrain_ray.model.presets import preset_model
from megatrain_ray.model.quant_layout import QuantLayout

CASES = ("qwen3-30b-a3b:nf4", "qwen3-30b-a3b:mxfp4", "gpt-oss-20b:mxfp4", "70b:nf4")
"""preset:format of the layers timed by default (a sparse layer of each mixture of experts, the
70B shape's dense layer)."""


def one_layer(preset: str, fmt: str, dtype: torch.dtype) -> QuantizedBase:
    """A 1-layer model of ``preset`` quantized to ``fmt``; its decoder layer (unit 1) holds
    N(0, 0.02) weights (the rest stays zero: it is not timed)."""
    cfg = preset_model(preset, 1)
    layout = QuantLayout.build(cfg, fmt, dtype)
    base = QuantizedBase(cfg, fmt, dtype, torch.zeros(layout.total, dtype=torch.uint8))
    g = torch.Generator().manual_seed(0)
    for name, shape, _ in base.templates[1].params:
        base.write(1, name, torch.randn(shape, generator=g) * 0.02)
    return base


def _median_s(fn, device: str, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` calls after two warm-ups, each call synchronised."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for i in range(reps + 2):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(preset: str, fmt: str, device: str, reps: int) -> dict:
    """One layer's dequantization and the copy of its bytes, timed in turn (see the module docstring)."""
    dtype = torch.bfloat16
    base = one_layer(preset, fmt, dtype)
    block = base.block(1)
    pinned = block.pin_memory() if device == "cuda" else block.clone()
    slot = torch.zeros(base.layout.largest([1]), dtype=torch.uint8, device=device)
    dequant = DeviceDequant(base.layout, base.templates, [slot], dtype)
    slot[:block.numel()].copy_(pinned)
    numel = base.templates[1].numel
    copy_s = _median_s(lambda: slot[:block.numel()].copy_(pinned, non_blocking=True), device, reps)
    dequant_s = _median_s(lambda: dequant.weights(0, 1, None), device, reps)
    return {"preset": preset, "format": fmt, "params": numel, "bytes": block.numel(),
            "bytes_per_param": block.numel() / numel, "dequant_ms": dequant_s * 1e3,
            "dequant_gbps": (block.numel() + dtype.itemsize * numel) / dequant_s / 1e9,
            "copy_ms": copy_s * 1e3, "copy_gbps": block.numel() / copy_s / 1e9, "ratio": dequant_s / copy_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", help=f"preset:format, repeatable (default: {', '.join(CASES)})")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", required=True, help="folder for dequant-rate.json")
    args = ap.parse_args()
    rows = []
    for case in args.case or CASES:
        preset, fmt = case.split(":")
        r = measure(preset, fmt, args.device, args.reps)
        rows.append(r)
        print(f"{preset} {fmt}: one layer, {r['params'] / 1e6:,.0f}M parameters, {r['bytes'] / 2**20:,.0f} MiB "
              f"({r['bytes_per_param']:.3f} B/param): dequantized in {r['dequant_ms']:.2f} ms "
              f"({r['dequant_gbps']:,.0f} GB/s read + written), copied in {r['copy_ms']:.2f} ms "
              f"({r['copy_gbps']:,.1f} GB/s); dequantization / copy {r['ratio']:.2f}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    with open(os.path.join(args.out, "dequant-rate.json"), "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
