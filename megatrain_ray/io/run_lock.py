"""A run directory held by the process that trains it, so that two processes never meet in one run.

A training process holds its own run directory and, when it resumes, the run directory it resumes
from, for as long as it lives: a second process that would train or resume the same run (and prune
the checkpoint the other is reading, or write beside it) is refused in one sentence naming the
first by its process id. The lock is an ``flock`` on the directory itself: no file is written, and
it ends with the process however the process ends (``kill -9`` included), so none is ever stale.
"""

from __future__ import annotations

import fcntl
import os

from ..errors import CheckpointError


def run_of(path: str) -> str:
    """The run directory of a path given to ``--resume``: ``runs/<id>`` of ``runs/<id>/checkpoints/step-N``
    and of ``runs/<id>/checkpoints``; a run directory, or a checkpoint outside a run, itself."""
    path = os.path.abspath(path)
    if os.path.basename(path) == "checkpoints":
        return os.path.dirname(path)
    parent = os.path.dirname(path)
    return os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else path


def check(directory: str, doing: str) -> None:
    """Refuse (as :func:`acquire`) if another process holds ``directory``, holding nothing: said before a
    checkpoint of a run that another process trains, and may be pruning, is read."""
    if os.path.isdir(directory):
        release(acquire(directory, doing))


def acquire(directory: str, doing: str) -> int:
    """Hold ``directory`` for this process (see the module docstring); returns the descriptor to pass
    to :func:`release`. ``doing``: what this process does with it, for the other's refusal."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        who = f"process {holder}" if holder else "another process"
        raise CheckpointError(f"the run directory {directory} is in use by {who}, which trains or resumes that run; "
                              f"wait for it to end (or stop it: Ctrl-C saves a checkpoint) before {doing} it.") from None
    return fd


def release(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # the flock goes with the last descriptor


def _holder(fd: int) -> int | None:
    """The process id holding an flock on ``fd``'s inode, from /proc/locks (None where unknown)."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 5 and parts[1] == "FLOCK" and parts[5] == inode and parts[4].isdigit():
                    return int(parts[4])
    except OSError:
        pass
    return None
