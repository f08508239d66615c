"""What a checkpoint costs: CRC-32 and copy rates, the write rate, and the sink's stall behind a background save.

    python benchmarks/checkpoint_cost.py OUT                      # a 3.5 GB checkpoint, written under OUT
    python benchmarks/checkpoint_cost.py OUT --layers 4 --dir /nvme/ckpt --step-s 6.5
    python benchmarks/checkpoint_cost.py OUT --preset tiny --layers 2 --step-s 0.2   # a smoke run, ~70 MB

The store is a real shared-memory store of a preset's shape (``--preset``, default the 7B:
Qwen2.5-7B) cut to ``--layers`` decoder layers and ``--vocab`` tokens; the checkpoint is written by the run's writer
(:class:`megatrain_ray.io.writer.CheckpointWriter`) to ``--dir`` (default: OUT/ckpt). Measured:

- ``crc32``: zlib.crc32 over the store's master array in 64 MiB chunks, one thread (what the
  checksum thread of each file does while the file is written), per second of that thread's CPU
  time (what it costs a core, whatever else the machine runs) and of wall time;
- ``copy``: torch copy_ of the master array into a fresh buffer (what a staging copy would cost);
- ``paused``: a foreground save (the store actor's), start to fsynced rename, and its rate;
- ``background``: the sink's save: started at a boundary, then, after ``--step-s`` seconds (the next
  step's forward and backward, before its first update), every unit updated in backward order
  (before_update, then the unit's three kinds changed in place, at ``--adamw-gbs`` GB/s of state,
  the measured 7B AdamW rate): the stall is the time the updates waited for the writer.

Then the 7B extrapolation: 7.62e9 parameters x 12 bytes (fp32 master + two fp32 moments) = 91.4 GB per
checkpoint; the stall per checkpoint is about max(0, bytes / write rate - step time) (the writer has
one step before the sink needs the first unit), against a budget of 5% of the time between two
checkpoints (checkpoint_every=50 steps of --step-s seconds). The CRC costs bytes / crc rate of one
core, on the checksum threads, overlapping the writes. Results go to OUT/checkpoint_cost.json; the
table is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_ray.engine.store.host_store import ParameterStore, StoreSpec  # noqa: E402
from megatrain_ray.io.checkpoint import CheckpointSettings  # noqa: E402
from megatrain_ray.io.writer import CheckpointWriter, checkpoint_bytes  # noqa: E402
from megatrain_ray.model.precision import Precision  # noqa: E402
from megatrain_ray.model.presets import PRESETS, preset_model  # noqa: E402

PARAMS_7B = 7.62e9
BYTES_PER_PARAM = 12  # fp32 master + exp_avg + exp_avg_sq
ADAMW_7B_S = 1.5  # the measured AdamW time of one 7B step (benchmarks/results/2026-11-30_h200x2_multi-gpu-convergence/NOTES.md)


def rate(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--preset", default="7b", choices=sorted(PRESETS), help="the shape of the measured store")
    ap.add_argument("--layers", type=int, default=1, help="decoder layers of the shape (the 7B's: 233M parameters each)")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary (the 7B's 152064 adds 545M parameters)")
    ap.add_argument("--dir", help="where the checkpoints are written (default OUT/ckpt)")
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument("--step-s", type=float, default=5.4,
                    help="step time (the 7B defaults on one H200: 5.43 s, results/2026-12-01_h200_defaults-7b)")
    ap.add_argument("--adamw-gbs", type=float, default=PARAMS_7B * 12 / ADAMW_7B_S / 1e9,
                    help="GB/s of optimizer state the sink's AdamW goes through (7B: 91 GB in 1.5 s)")
    ap.add_argument("--every", type=int, default=50, help="train.checkpoint_every of the extrapolation")
    ap.add_argument("--staging-gib", type=float, default=0.0,
                    help="train.checkpoint_staging_gib of the background save")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    where = args.dir or os.path.join(args.out, "ckpt")
    model = dataclasses.replace(preset_model(args.preset, args.layers), vocab_size=args.vocab)
    ps = ParameterStore(StoreSpec(model, Precision(torch.float32, torch.bfloat16), args.shm_dir, os.getpid(),
                                  "ckptcost"), 0)
    report: dict = {"preset": args.preset, "layers": args.layers, "vocab": args.vocab, "dir": where, "threads": torch.get_num_threads()}
    try:
        store = ps.store
        nbytes = checkpoint_bytes(store)
        report["checkpoint_bytes"] = nbytes
        master = store.arrays["master"]
        raw = memoryview(master.view(torch.uint8).numpy()).cast("B")
        began, cpu = time.perf_counter(), time.thread_time()
        crc, chunk = 0, 64 * 2**20
        for start in range(0, len(raw), chunk):
            crc = zlib.crc32(raw[start:start + chunk], crc)
        report["crc32_gbs"] = rate(len(raw), time.thread_time() - cpu)  # per second of this thread's CPU
        report["crc32_wall_gbs"] = rate(len(raw), time.perf_counter() - began)
        copy = torch.empty_like(master)
        copy.copy_(master)  # fault the pages in
        began = time.perf_counter()
        copy.copy_(master)
        report["copy_gbs"] = rate(master.numel() * master.element_size(), time.perf_counter() - began)
        del copy

        units = len(store.layout.units)
        for i in range(units):
            store.set_version(i, 1)
        checkpoints = CheckpointSettings(where, every=1, keep=1, run_config={}, run_id="cost",
                              staging_bytes=int(args.staging_gib * 2**30))
        shutil.rmtree(where, ignore_errors=True)
        began = time.perf_counter()
        CheckpointWriter(store, checkpoints).save(1)
        report["paused_s"] = time.perf_counter() - began
        report["paused_gbs"] = rate(nbytes, report["paused_s"])

        shutil.rmtree(where, ignore_errors=True)  # the same boundary again, written afresh
        writer = CheckpointWriter(store, checkpoints)
        began = time.perf_counter()
        writer.start(1, list(range(units))[::-1])
        time.sleep(args.step_s)
        for i in reversed(range(units)):
            writer.before_update(i)
            unit_bytes = store.layout.templates[i].numel * 12
            t0 = time.perf_counter()
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                store.block(kind, i).add_(1.0)
            time.sleep(max(0.0, unit_bytes / (args.adamw_gbs * 1e9) - (time.perf_counter() - t0)))
            store.set_version(i, 2)
        notice = writer.finish()
        report["background_save_s"] = notice["save_s"]
        report["background_stall_s"] = notice["stall_s"]
        report["background_wall_s"] = time.perf_counter() - began
        report["background_staged_bytes"] = notice["staged_bytes"]
    finally:
        ps.close()
        shutil.rmtree(where, ignore_errors=True)

    b7 = PARAMS_7B * BYTES_PER_PARAM
    write_gbs = report["paused_gbs"]
    interval = args.every * args.step_s
    stall = max(0.0, b7 / (write_gbs * 1e9) - args.step_s)
    report["7b"] = {"checkpoint_bytes": b7, "write_s_at_measured_rate": b7 / (write_gbs * 1e9),
                    "stall_s_estimate": stall, "interval_s": interval, "budget_s": 0.05 * interval,
                    "stall_share_of_interval": stall / interval, "crc_core_s": b7 / (report["crc32_gbs"] * 1e9),
                    "write_gbs_needed_for_5pct": b7 / (0.05 * interval + args.step_s) / 1e9,
                    "staging_copy_s": b7 / (report["copy_gbs"] * 1e9)}
    with open(os.path.join(args.out, "checkpoint_cost.json"), "w") as f:
        json.dump(report, f, indent=2)
    r7 = report["7b"]
    rows = [
        ("checkpoint measured", f"{nbytes / 1e9:.2f} GB ({args.layers} layers of the {args.preset} shape, vocab {args.vocab})"),
        ("CRC-32, one thread",
         f"{report['crc32_gbs']:.2f} GB/s of CPU time ({report['crc32_wall_gbs']:.2f} GB/s wall)"),
        ("copy (torch copy_)", f"{report['copy_gbs']:.2f} GB/s on {report['threads']} threads"),
        ("paused save (write+CRC+fsync)", f"{report['paused_s']:.2f} s = {report['paused_gbs']:.2f} GB/s to {where}"),
        ("background save", f"{report['background_save_s']:.2f} s; sink stalled {report['background_stall_s']:.2f} s "
                            f"(updates began {args.step_s:g} s after the boundary; "
                            f"{report['background_staged_bytes'] / 1e9:.2f} GB staged)"),
        ("7B checkpoint", f"{b7 / 1e9:.1f} GB: {r7['write_s_at_measured_rate']:.1f} s at the measured rate"),
        ("7B CRC cost", f"{r7['crc_core_s']:.1f} s of one core, overlapping the writes"),
        ("7B stall per checkpoint", f"~{r7['stall_s_estimate']:.1f} s = {100 * r7['stall_share_of_interval']:.1f}% of "
                                    f"{args.every} steps x {args.step_s:g} s (budget 5% = {r7['budget_s']:.1f} s)"),
        ("write rate for <= 5% at 7B", f"{r7['write_gbs_needed_for_5pct']:.2f} GB/s"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
