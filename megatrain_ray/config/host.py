"""What the host offers a run: the CPUs this process may use, and whether a directory can be written."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask: taskset, cpusets), not all the machine has."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 2


def unwritable(path: str) -> str | None:
    """Why a file cannot be created in directory ``path`` (or, where it does not exist yet, in the
    nearest parent it would be created under), or None if one can."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"{probe} is a file"
    if not os.access(probe, os.W_OK | os.X_OK):
        return "a read-only file system" if os.statvfs(probe).f_flag & os.ST_RDONLY else f"{probe} is not writable"
    return None
