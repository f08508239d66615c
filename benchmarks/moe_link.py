"""Does a sparse layer cross the link as fast as a dense layer of the same bytes?

One decoder layer of a preset's mixture-of-experts shape, in pinned host memory as the store holds
it (compute dtype), copied to a device slot by the compute worker's own backend
(:mod:`megatrain_ray.engine.compute.device`) with the ranges the engine picks
(:class:`~megatrain_ray.engine.experts.ExpertTraffic`), against a dense block of the same bytes
copied whole:

- h2d: the forward's fetch (whole), the backward's with every expert routed (the ranges merge
  into the whole block) and with ``--idle`` of the experts given no token (one run of idle experts
  per ``--runs``: the copies the engine then makes);
- d2h: a fp32 gradient of the layer sent whole, and with the same experts idle.

Prints one line per case (GB/s, copies, and the ratio to the dense copy) and writes
OUT/moe-link-<tag>.json. The question's bar: every expert routed within 5% of dense.
  python3 benchmarks/moe_link.py --preset qwen3-30b-a3b --out OUT          # one GPU
  python3 benchmarks/moe_link.py --preset small-moe --device cpu --out OUT  # the CPU (smoke)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import torch

from megatrain_ray.engine.compute.device import make_backend
from megatrain_ray.engine.experts import ExpertTraffic
from megatrain_ray.engine.policy import ROUTED, UnitPolicy
from megatrain_ray.model.layout import StoreLayout
from megatrain_ray.model.presets import preset_model


def _timed(backend, fns, reps: int) -> list[float]:
    """Median seconds per call of each of ``fns`` (copies), called in turn ``reps`` times after one
    warm-up each (interleaved, so that a drift of the machine touches all alike), the device
    synchronised around every call."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(reps):
        for fn, out in zip(fns, times):
            backend.synchronize()
            start = time.perf_counter()
            fn()
            backend.synchronize()
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def measure(preset: str, device: str, idle: int, runs: int, reps: int, dtype=torch.bfloat16) -> dict:
    cfg = preset_model(preset, 1)
    layout = StoreLayout.build(cfg)
    unit = layout.layers[0]
    numel = layout.templates[unit.index].numel
    backend = make_backend(device, 1, numel, dtype)
    host = backend.host_buffer((numel,), dtype)
    host.normal_()
    grad_host = backend.host_buffer((numel,), torch.float32)
    grad = torch.randn(numel, device=backend.device)
    scalar = torch.zeros((), device=backend.device)
    traffic = ExpertTraffic(layout, backend, threading.Event())
    policy = UnitPolicy(experts=ROUTED)
    e = cfg.num_experts
    idle = min(idle, e // 2)
    chosen = torch.ones(e)
    for r in range(runs):  # runs of consecutive idle experts, spread over the layer
        start = r * (e // runs)
        chosen[start:start + max(1, idle // runs)] = 0
    idle_count = int((chosen == 0).sum())

    def routed(step: int, counts: torch.Tensor) -> tuple[list | None, list | None]:
        """The ranges the engine fetches for the backward and sends of the gradient under this routing."""
        traffic.begin_step(step)
        traffic.record(step, unit.layer, counts.to(backend.device))
        sent, _ = traffic.grad_ranges(unit.index, step, policy, 4)
        return traffic.fetch_ranges(unit.index, step, True), sent

    all_fetch, all_sent = routed(0, torch.full((e,), 8.0))
    some_fetch, some_sent = routed(1, chosen * 8)
    cases = [  # (name, lane, ranges, copy); the first of each lane is the dense reference
        ("dense layer", "h2d", None, lambda: backend.load(0, host)),
        ("sparse forward (whole)", "h2d", None, lambda: backend.load(0, host, "", None)),
        ("sparse backward, every expert routed", "h2d", all_fetch, lambda: backend.load(0, host, "", all_fetch)),
        (f"sparse backward, {idle_count} of {e} experts idle", "h2d", some_fetch,
         lambda: backend.load(0, host, "", some_fetch)),
        ("dense gradient", "d2h", None, lambda: backend.store(grad, grad_host, scalar).result()),
        ("sparse gradient, every expert routed", "d2h", all_sent,
         lambda: backend.store(grad, grad_host, scalar, "", all_sent).result()),
        (f"sparse gradient, {idle_count} of {e} experts idle", "d2h", some_sent,
         lambda: backend.store(grad, grad_host, scalar, "", some_sent).result()),
    ]
    rows = {}
    for lane, itemsize in (("h2d", dtype.itemsize), ("d2h", 4)):
        mine = [c for c in cases if c[1] == lane]
        seconds = _timed(backend, [c[3] for c in mine], reps)
        for (name, _, ranges, _), t in zip(mine, seconds):
            nbytes = (numel if ranges is None else sum(b - a for a, b in ranges)) * itemsize
            rows[name] = {"lane": lane, "bytes": nbytes, "copies": 1 if ranges is None else len(ranges),
                          "seconds": t, "gbps": nbytes / t / 1e9, "vs_dense": seconds[0] and nbytes / t / (
                              numel * itemsize / seconds[0])}
    backend.close()
    return {"preset": preset, "device": device, "layer_bytes": numel * dtype.itemsize, "experts": e,
            "idle": idle_count, "reps": reps, "rows": rows,
            "all_routed_within_5pct": all(rows[k]["vs_dense"] >= 0.95 for k in (
                "sparse backward, every expert routed", "sparse gradient, every expert routed"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--idle", type=int, default=16, help="experts given no token in the partial case")
    ap.add_argument("--runs", type=int, default=4, help="runs of consecutive idle experts they form")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    report = measure(a.preset, a.device, a.idle, a.runs, a.reps)
    for name, r in report["rows"].items():
        print(f"link {r['lane']}  {name:<42} {r['bytes'] / 1e6:9.1f} MB in {r['copies']:>3} copies  "
              f"{r['gbps']:7.2f} GB/s  ({r['vs_dense']:.3f} of dense)")
    print(f"every expert routed within 5% of a dense layer: {report['all_routed_within_5pct']}")
    path = os.path.join(a.out, f"moe-link-{a.tag or a.preset}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
