"""torch.profiler around one training step of a compute worker (train.profile_steps).

What the step ran in the worker's process goes into a directory of its own: ``trace.json.gz``, a
Chrome trace (Perfetto or chrome://tracing opens it) of its CPU operators and, on a GPU, of every
kernel and copy on every stream, the updates beside the forward included; and ``kernels.txt``,
where the device's time went (:func:`summary`): the step's span from its first kernel to its last,
the time some kernel ran (their union over the streams) and the idle rest with its largest gaps, the
kernels' time by kind (:data:`KINDS`) and by name, and the copies' by direction; then torch's own
table of operators by their time. On the CPU, which has no device events, only that table.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
from collections import Counter

KINDS = (("attention", ("flash", "fmha", "attention", "sdpa")),
         ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "wgmma")),
         ("compiled (Triton)", ("triton",)),
         ("reduction", ("reduce",)))
"""Kinds of kernel by what their names contain, in this order (a flash-attention kernel's name also
names CUTLASS); any other kernel is an ATen elementwise or other kernel."""
OTHER = "elementwise and other ATen kernels"
GAPS_LISTED = 15
"""The largest idle gaps of the device the summary lists."""
KERNELS_LISTED = 40
"""The kernels the summary lists, by their total time."""


def kind_of(name: str) -> str:
    """The kind of a kernel of that name (see :data:`KINDS`)."""
    low = name.lower()
    return next((kind for kind, marks in KINDS if any(m in low for m in marks)), OTHER)


def records_kernels(device) -> bool:
    """Whether a profile on ``device`` (a torch.device or its name) records device kernels: on a GPU,
    whatever its index."""
    import torch

    return torch.device(device).type == "cuda"


@contextlib.contextmanager
def profiled(directory: str | None, device):
    """Record what runs inside into ``directory`` (trace.json.gz and kernels.txt, see the module
    docstring), made if missing; None: record nothing. device: the worker's (a torch.device or its
    name: cpu, cuda, cuda:1), whose kernels are recorded where it is a GPU."""
    if directory is None:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = records_kernels(device)
    if cuda:
        torch.cuda.synchronize()  # the step's work starts inside, not before
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()
    os.makedirs(directory, exist_ok=True)
    raw = os.path.join(directory, "trace.json")
    prof.export_chrome_trace(raw)
    with open(raw) as f:
        events = json.load(f).get("traceEvents", [])
    with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=KERNELS_LISTED, max_name_column_width=90)
    with open(os.path.join(directory, "kernels.txt"), "w") as f:
        f.write(summary(events) + "\nOperators (torch.profiler):\n" + table + "\n")


def summary(events: list[dict]) -> str:
    """The device's time in a Chrome trace's ``events`` (see the module docstring); times in the
    trace are microseconds, the summary's milliseconds."""
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kernels:
        return "No device kernels in this step (a CPU run): the operators' table below is its time.\n"
    first, last = kernels[0]["ts"], max(e["ts"] + e["dur"] for e in kernels)
    busy, gaps, start, end = 0.0, [], kernels[0]["ts"], kernels[0]["ts"]
    for e in kernels:
        if e["ts"] > end:
            busy += end - start
            gaps.append((e["ts"] - end, end - first, e["name"]))
            start = e["ts"]
        end = max(end, e["ts"] + e["dur"])
    busy += end - start
    span = last - first
    by_kind, by_name, calls = Counter(), Counter(), Counter()
    for e in kernels:
        by_kind[kind_of(e["name"])] += e["dur"]
        by_name[e["name"]] += e["dur"]
        calls[e["name"]] += 1
    copies = Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("gpu_memcpy", "gpu_memset"):
            copies[e["name"].split(" ")[0] if e["cat"] == "gpu_memcpy" else "Memset"] += e["dur"]
    lines = [f"Device time of the step: {span / 1e3:.1f} ms from its first kernel to its last, "
             f"{len(kernels):,} kernels; some kernel running {busy / 1e3:.1f} ms ({100 * busy / span:.1f}%), "
             f"idle {(span - busy) / 1e3:.1f} ms in {len(gaps):,} gaps",
             "Kernels by kind (ms, summed over streams): "
             + ", ".join(f"{kind} {t / 1e3:.1f}" for kind, t in by_kind.most_common()),
             "Copies and sets (ms, on the copy engines beside the kernels): "
             + (", ".join(f"{name} {t / 1e3:.1f}" for name, t in copies.most_common()) or "none"),
             "Largest idle gaps (ms, at ms into the span, the kernel after):"]
    lines += [f"  {g / 1e3:9.2f} {at / 1e3:10.1f}  {name[:100]}" for g, at, name in sorted(gaps, reverse=True)[:GAPS_LISTED]]
    lines.append("Kernels by total time (ms, calls, kind, name):")
    lines += [f"  {t / 1e3:9.1f} {calls[name]:7,}  {kind_of(name):18s} {name[:120]}"
              for name, t in by_name.most_common(KERNELS_LISTED)]
    return "\n".join(lines) + "\n"
