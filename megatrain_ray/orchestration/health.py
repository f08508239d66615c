"""Health checks of a run's roles while the driver waits on a step: a death or a freeze is noticed in seconds.

The driver already holds a call in flight on the busy roles (each compute worker's ``run_step``,
each prefetcher's and sink's ``run`` loop), and Ray fails such a call the moment its actor dies. The
other roles — the parameter stores, the data loaders and each node's queue host (the actor holding
the queues between the roles, :mod:`megatrain_ray.orchestration.queues`) — sit idle between calls,
so a death there went unnoticed until the next call (the store's: the final export).
:class:`Health` keeps one small call in flight on each of them too (a ping, sent again half a
second after the last answer), and:

- a ping that fails means the role died: :class:`~megatrain_ray.errors.ActorDied`, naming the role
  (the driver restarts the pipeline from the newest checkpoint, up to runtime.max_restarts times);
- a ping unanswered for runtime.health_timeout_s means the role hangs (an idle role answers in
  milliseconds), and a busy role whose process on this node is stopped (SIGSTOP, a debugger) or a
  zombie hangs too (a debugger's brief tracing stop does not count): also ActorDied, naming the role and its process id, so the run restarts rather
  than waiting for a queue timeout of minutes (runtime.actor_timeout_s).

A role busy in a long call cannot answer a ping (one call at a time), so its liveness is that
call's; a busy role that is alive and running but makes no progress is left to the queue timeouts.
"""

from __future__ import annotations

import os
import time

import ray

from ..errors import ActorDied
from .calls import get as _get


def _whereami(actor) -> tuple[int, str]:
    """(process id, Ray node id) of the actor it runs in (called through ``__ray_call__``)."""
    return os.getpid(), ray.get_runtime_context().get_node_id()


class Health:
    """See the module docstring. ``idle``/``busy``: role name -> actor handle (the queue hosts are idle roles)."""

    INTERVAL_S = 0.5

    def __init__(self, idle: dict, busy: dict, timeout_s: float, start_timeout_s: float):
        """``start_timeout_s``: how long a role may take to come up and say where it runs (runtime.actor_timeout_s)."""
        self.timeout_s = timeout_s
        self.idle = dict(idle)
        handles = {**self.idle, **busy}
        refs = {name: h.__ray_call__.remote(_whereami) for name, h in handles.items()}
        where = {name: _get(ref, name, start_timeout_s) for name, ref in refs.items()}
        here = ray.get_runtime_context().get_node_id()
        self.pids = {name: pid for name, (pid, node) in where.items() if node == here}
        """role -> process id, for the roles on this node (their processes can be inspected here)."""
        self.busy = [name for name in busy if name in self.pids]
        self.pings: dict[str, tuple] = {}
        """role -> (ping ref, time sent)."""
        self.answered: dict[str, float] = {}
        """role -> when its last ping was answered."""

    def check(self) -> None:
        """Raise ActorDied naming the first role found dead or hung; else send the pings that are due."""
        now = time.monotonic()
        for name, (ref, sent) in list(self.pings.items()):
            done, _ = ray.wait([ref], timeout=0)
            if done:
                _get(ref, name, self.timeout_s)  # a dead role raises ActorDied here
                del self.pings[name]
                self.answered[name] = now
            elif now - sent > self.timeout_s:
                raise ActorDied(f"the {name} actor has not answered a health check for {self.timeout_s:.0f} s, so it "
                                f"hangs{self._pid(name)}; see its stack in the Ray dashboard, or raise "
                                "runtime.health_timeout_s if it is only slow.")
        for name in self.busy:
            status = _status(self.pids[name])
            if status == "stopped":  # SIGSTOP, a debugger: alive, but it will not go on
                raise ActorDied(f"the {name} actor's process {self.pids[name]} is stopped, so the run cannot go on; "
                                "see its log in the Ray dashboard or /tmp/ray/session_latest/logs.")
            if status in ("zombie", "dead", "gone"):  # noticed before Ray reports the death
                raise ActorDied(f"the {name} actor died (its process {self.pids[name]} is {status}); see its log in "
                                "the Ray dashboard or /tmp/ray/session_latest/logs.")
        for name, handle in self.idle.items():
            if name not in self.pings and now - self.answered.get(name, 0.0) >= self.INTERVAL_S:
                self.pings[name] = (handle.health_ping.remote(), now)  # (orchestration.labels)

    def _pid(self, name: str) -> str:
        return f" (process {self.pids[name]})" if name in self.pids else ""


def _status(pid: int) -> str:
    """A process's state as /proc tells it (running, sleeping, stopped, zombie, ...), or ``gone``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return {"R": "running", "S": "sleeping", "D": "disk-sleep", "T": "stopped", "t": "tracing-stop",
            "Z": "zombie", "X": "dead", "I": "idle"}.get(state, state)
