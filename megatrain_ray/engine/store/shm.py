"""Named shared-memory segments (files on a tmpfs such as /dev/shm) and their cleanup.

Segments are named ``megatrain-<owner pid>-<run id>-<kind>`` so a leftover is attributable to the
run (and process) that made it: :func:`remove_run` deletes one run's segments on every exit path,
and :func:`remove_stale` deletes those whose owner process no longer exists (after a SIGKILL, say).
Mapping is zero-copy and shared (``torch.from_file(shared=True)``), so every actor on the node sees
the same bytes; the mapping's base address is page-aligned.
"""

from __future__ import annotations

import glob
import os

import torch

PREFIX = "megatrain-"


def segment_path(shm_dir: str, owner_pid: int, run_id: str, kind: str) -> str:
    return os.path.join(shm_dir, f"{PREFIX}{owner_pid}-{run_id}-{kind}")


def create(path: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Create a zero-filled segment of ``numel`` elements and map it. Fails if it already exists."""
    nbytes = numel * dtype.itemsize
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return attach(path, numel, dtype)


def attach(path: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Map an existing segment as a flat tensor [numel] of ``dtype``, shared and writable."""
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    return torch.from_file(path, shared=True, size=numel, dtype=dtype)


def run_segments(shm_dir: str, owner_pid: int, run_id: str) -> list[str]:
    return sorted(glob.glob(os.path.join(shm_dir, f"{PREFIX}{owner_pid}-{run_id}-*")))


def remove_run(shm_dir: str, owner_pid: int, run_id: str) -> list[str]:
    """Unlink every segment of one run (mappings stay valid until unmapped); returns what was removed."""
    return _unlink(run_segments(shm_dir, owner_pid, run_id))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(shm_dir: str) -> list[str]:
    """Unlink segments whose owner process is gone; returns what was removed."""
    def dead(path: str) -> bool:
        owner = os.path.basename(path)[len(PREFIX):].split("-", 1)[0]
        return owner.isdigit() and not _alive(int(owner))

    return _unlink(p for p in glob.glob(os.path.join(shm_dir, f"{PREFIX}*")) if dead(p))


def _unlink(paths) -> list[str]:
    """Unlink each path that still exists; returns those removed."""
    removed = []
    for path in paths:
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
