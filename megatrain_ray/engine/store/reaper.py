"""The shared-memory reaper: removes a run's segments within a second of its store or driver dying.

A store removes its segments itself on every orderly exit, and the driver removes them on every exit
path it lives to see. Neither runs when a process is killed with SIGKILL: ``kill -9`` of the driver
makes Ray end the actors (the store among them) without a word, and the segments stayed in /dev/shm
until the next run's :func:`~megatrain_ray.engine.store.shm.remove_stale`.

So two reapers watch each run's segments (:func:`start`): the driver starts one for the segments of
the run on its node (every attempt's, as a glob pattern), watching itself; each
:class:`~megatrain_ray.engine.store.host_store.ParameterStore` starts one for its own segments, watching its
own process (on every node, where the driver cannot be watched). A reaper is a small process of its
own session, outside Ray's process tree (started through a launcher that exits at once, so Ray's
clean-up of a dead worker's children does not take it along), which polls every 0.2 s: when a
watched process has ended or is a zombie, it unlinks what the patterns match and exits; a store's
reaper also exits once its segments are gone (the run removed them), the driver's when the driver
releases it at the end of the run (its lease pipe; the pipe's end of file, when the driver dies,
reaps at once). Run as ``python reaper.py PATTERNS_JSON UNTIL_GONE LEASE PID...``: the standard
library only, no torch, so it starts in tens of milliseconds and holds a few MiB.
"""

from __future__ import annotations

import glob
import json
import os
import select
import subprocess
import sys
import time

POLL_S = 0.2


def _alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie (a killed process its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def watch(patterns: list[str], pids: list[int], until_gone: bool = True, lease=None) -> str:
    """Poll until a watched process ends (unlinks what ``patterns`` match, returns ``reaped``) or, with
    ``until_gone``, until nothing matches any more (returns ``gone``). ``lease``: a pipe from the
    watched process; ``done`` on it releases the reaper (returns ``released``), its end of file (the
    process died: the kernel closed its end) reaps at once."""
    while True:
        if until_gone and not any(glob.glob(p) for p in patterns):
            return "gone"
        ended = not all(_alive(pid) for pid in pids)
        if lease is not None and not ended and select.select([lease], [], [], POLL_S)[0]:
            line = lease.readline()
            if line.startswith(b"done"):
                return "released"
            ended = not line
        elif lease is None and not ended:
            time.sleep(POLL_S)
        if ended:
            for path in (path for p in patterns for path in glob.glob(p)):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            return "reaped"


_LAUNCH = ("import subprocess, sys; subprocess.Popen(sys.argv[2:], start_new_session=True, stdin=None if sys.argv[1] "
           "== 'lease' else subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)")


def start(patterns: list[str], pids: list[int], until_gone: bool = True, lease: bool = False):
    """Start a detached reaper of what ``patterns`` (paths or glob patterns) match, watching ``pids``
    (see the module docstring). With ``lease``, returns the write end of its lease pipe: write
    ``done`` and close it to let the reaper go without reaping."""
    argv = [sys.executable, "-c", _LAUNCH, "lease" if lease else "-", sys.executable, os.path.abspath(__file__),
            json.dumps(patterns), str(int(until_gone)), str(int(lease)), *map(str, pids)]
    launcher = subprocess.Popen(argv, stdin=subprocess.PIPE if lease else subprocess.DEVNULL)
    if launcher.wait(timeout=60) != 0:
        raise OSError(f"the shared-memory reaper did not start (status {launcher.returncode})")
    return launcher.stdin


def release(lease) -> None:
    """Let a reaper started with ``lease=True`` go without reaping (the run cleaned up itself)."""
    try:
        lease.write(b"done\n")
        lease.close()
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    with_lease = bool(int(sys.argv[3]))
    watch(json.loads(sys.argv[1]), [int(a) for a in sys.argv[4:]], until_gone=bool(int(sys.argv[2])),
          lease=sys.stdin.buffer if with_lease else None)
