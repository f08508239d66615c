"""One row per benchmark run of a device script: `megatrain_ray.bench --tag TAG --out OUT` wrote
OUT/bench-TAG.json; this prints s/step, TFLOPS in both conventions, GPU peak, compute busy share and
how long the compute worker waited for weights (AdamW), for the tags given, in that order.

    python3 benchmarks/bench_table.py OUT TAG [TAG ...]
"""

from __future__ import annotations

import json
import os
import sys


def table(out: str, tags: list[str]) -> str:
    width = max(12, *(len(t) + 2 for t in tags))
    lines = [f"{'run':<{width}}{'s/step':>8}{'TF 6NT':>8}{'TF PaLM':>9}{'GPU GiB':>9}{'busy':>7}{'wait s':>8}"]
    for tag in tags:
        path = os.path.join(out, f"bench-{tag}.json")
        if not os.path.exists(path):
            lines.append(f"{tag:<{width}}  (no result: see log_{tag}.txt)")
            continue
        with open(path) as f:
            r = json.load(f)["systems"]["megatrain_ray"]
        wait = r.get("wait_busy_frac", 0) * r["step_s"]
        lines.append(f"{tag:<{width}}{r['step_s']:>8.3f}{r['tflops_6nt']:>8.1f}{r['tflops_palm']:>9.1f}"
                     f"{r.get('device_peak_gib', 0):>9.1f}{r.get('compute_busy_frac', 0):>7.1%}{wait:>8.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    print(table(sys.argv[1], sys.argv[2:]))
