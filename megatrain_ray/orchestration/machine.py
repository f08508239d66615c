"""What this machine has, read before Ray starts: RAM a new run can use (cgroup limits included),
the GPU's memory, the device ``compute.device: auto`` will get, and the RAM Ray's memory monitor
wants left free. :mod:`.preflight` weighs a run's needs against these.
"""

from __future__ import annotations

import os

from ..config import TrainConfig

RAY_MEMORY_THRESHOLD = 0.95
"""Ray's memory monitor kills workers once the node's used memory passes this share of its RAM
(``RAY_memory_usage_threshold``; ``RAY_memory_monitor_refresh_ms=0`` turns the monitor off)."""


def host_available(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """Bytes of RAM a new run can use: MemAvailable, capped by the memory limits of this process's
    cgroup and those above it."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    for limit_file, usage_file in _cgroup_memory_files(cgroup_root):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:
            avail = min(avail, int(limit) - usage)
    return max(0, avail)


def _cgroup_memory_files(root: str = "/sys/fs/cgroup") -> list[tuple[str, str]]:
    """(limit, usage) files of this process's memory cgroup and each one above it, v2 and v1
    (paths that do not exist, e.g. in a container without a cgroup namespace, are skipped)."""
    def chain(base: str, path: str, limit: str, usage: str) -> list[tuple[str, str]]:
        out = []
        while True:
            d = os.path.join(base, path.strip("/"))
            out.append((os.path.join(d, limit), os.path.join(d, usage)))
            if path.strip("/") == "":
                return out
            path = os.path.dirname(path.rstrip("/"))

    v2, v1 = "/", "/"
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    v2 = path
                elif "memory" in controllers.split(","):
                    v1 = path
    except (OSError, ValueError):
        pass
    return (chain(root, v2, "memory.max", "memory.current")
            + chain(os.path.join(root, "memory"), v1, "memory.limit_in_bytes", "memory.usage_in_bytes"))


def gpu_memory() -> int | None:
    """Total memory of GPU 0 as this process sees it, or None without CUDA."""
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory)
    except Exception:
        pass
    return None


def gpu_name() -> str | None:
    """The name of GPU 0 as this process sees it (``NVIDIA H200``), or None without CUDA."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    return None


def guess_device(cfg: TrainConfig) -> str:
    """compute.device before Ray is up: auto means cuda when this process sees a GPU."""
    if cfg.compute.device != "auto":
        return cfg.compute.device
    return "cuda" if gpu_memory() is not None else "cpu"


def ray_threshold() -> float:
    try:
        return float(os.environ.get("RAY_memory_usage_threshold", RAY_MEMORY_THRESHOLD))
    except ValueError:
        return RAY_MEMORY_THRESHOLD


def ray_monitor_margin() -> int:
    """Bytes of RAM the run must leave free for Ray's memory monitor not to kill its workers."""
    if os.environ.get("RAY_memory_monitor_refresh_ms", "") == "0":
        return 0
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(max(0.0, 1.0 - ray_threshold()) * total)


def same_filesystem(a: str, b: str) -> bool:
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False


def gpu_free_memory() -> int | None:
    """Free memory of GPU 0 now (other processes' use subtracted), or None without CUDA."""
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.mem_get_info(0)[0])
    except Exception:
        pass
    return None
