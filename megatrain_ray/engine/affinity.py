"""CPU placement near the GPU: which CPUs a GPU is close to, which of them each role gets, and
pinning a whole process to a set of CPUs.

On a multi-socket box each GPU hangs off one socket's PCIe root; the kernel says which CPUs are
local to it in ``/sys/bus/pci/devices/<pci address>/local_cpulist`` (and its NUMA node in
``numa_node``). A compute worker's threads (the Python thread launching kernels, the loader,
releaser and grad-sender threads that wait on its copy streams) run best there, and the gradient
sink's AdamW threads on every other CPU, so the two never compete for a core:
:func:`pick_cpus` picks :data:`COMPUTE_CPUS` CPUs local to each worker's GPU (disjoint between
workers) and leaves the rest to AdamW. Where the machine gives no topology (no GPU, no sysfs entry)
nothing is pinned. The plan is a plain function of the topology, so it is tested on synthetic
machines; :func:`pin_process` applies it to every thread of the calling process.
"""

from __future__ import annotations

import os
import subprocess

SYSFS = "/sys"
COMPUTE_CPUS = 4
"""CPUs each compute worker is pinned to: one for its kernel-launching thread, the others shared by
its helper threads (they mostly wait on the copy streams), NCCL's proxy thread and Ray's own
threads; a 16-core socket with two GPUs still leaves 8 of its cores to AdamW."""


def parse_cpulist(text: str) -> list[int]:
    """The kernel's CPU list format (``0-3,8,10-11``) -> sorted CPU ids."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cpus)


def format_cpulist(cpus) -> str:
    """Sorted CPU ids -> the kernel's list format, ranges collapsed (``0-3,8``)."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def pci_address(bus_id: str) -> str:
    """A PCI bus id as nvidia-smi or CUDA write it (``00000000:18:00.0``) -> sysfs's (``0000:18:00.0``)."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) == 2:  # no domain
        parts = ["0000", *parts]
    domain = parts[0][-4:].rjust(4, "0")
    return ":".join([domain, *parts[1:]])


def gpu_pci_address(index: int = 0) -> str | None:
    """sysfs PCI address of this process's CUDA device ``index`` (torch's device properties, else
    nvidia-smi by the device's UUID), or None where neither says."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(index)
    if getattr(props, "pci_bus_id", None) is not None:
        domain, bus, device = (int(getattr(props, k, 0) or 0) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
        return f"{domain:04x}:{bus:02x}:{device:02x}.0"
    uuid = str(getattr(props, "uuid", "") or "")
    if not uuid:
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--id=GPU-{uuid.removeprefix('GPU-')}", "--query-gpu=pci.bus_id",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return pci_address(out.stdout) if out.returncode == 0 and out.stdout.strip() else None


def local_cpus(pci: str | None, sysfs: str = SYSFS) -> tuple[int | None, list[int] | None]:
    """(NUMA node or None, CPUs local to the PCI device or None) as the kernel reports them."""
    if pci is None:
        return None, None
    base = os.path.join(sysfs, "bus", "pci", "devices", pci)
    try:
        with open(os.path.join(base, "local_cpulist")) as f:
            cpus = parse_cpulist(f.read())
    except (OSError, ValueError):
        return None, None
    try:
        with open(os.path.join(base, "numa_node")) as f:
            node = int(f.read())
    except (OSError, ValueError):
        node = -1
    return (node if node >= 0 else None), (cpus or None)


def pick_cpus(worker_local: list[list[int] | None], usable: list[int],
              per_worker: int = COMPUTE_CPUS) -> tuple[list[list[int] | None], list[int] | None]:
    """(the CPUs of each compute worker, the CPUs left for AdamW) on one node.

    worker_local: per worker, the CPUs local to its GPU (None: unknown); usable: the CPUs the
    node's processes may run on. Worker w gets up to ``per_worker`` usable CPUs of its GPU's that
    no earlier worker took (None where its topology is unknown or none is left: not pinned).
    AdamW gets every usable CPU no worker got (None when that would leave it none: not pinned).
    """
    allowed, taken = set(usable), set()
    picks: list[list[int] | None] = []
    for local in worker_local:
        free = [c for c in (local or []) if c in allowed and c not in taken][:per_worker]
        taken.update(free)
        picks.append(free or None)
    rest = [c for c in sorted(allowed) if c not in taken]
    return picks, (rest if taken and rest else None)


def adamw_cpus_near(workers: int) -> int | None:
    """How many CPUs :func:`pick_cpus` leaves the gradient sink's AdamW on this machine, its ``workers``
    compute workers taking CUDA devices 0, 1, ... as Ray gives them out on one node (None where the
    topology does not say which CPUs are near those GPUs, or none would be left: nothing is pinned)."""
    usable = sorted(os.sched_getaffinity(0))
    picks, rest = pick_cpus([local_cpus(gpu_pci_address(w))[1] for w in range(workers)], usable)
    return len(rest) if rest and any(picks) else None


def pin_process(cpus: list[int]) -> int:
    """Restrict every thread of this process (and the threads it starts later) to ``cpus``;
    returns how many threads were pinned. (``sched_setaffinity(0)`` alone would move only the
    calling thread: the worker's helper threads and thread pools are already running.)"""
    pinned = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
            pinned += 1
        except (ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
            continue
    os.sched_setaffinity(0, cpus)
    return pinned
