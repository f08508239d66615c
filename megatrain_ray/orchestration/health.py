"""Health checks of a run's roles while the driver waits on a step: a death or a freeze is noticed in seconds.

The driver already holds a call in flight on the busy roles (each compute worker's ``run_step``,
each prefetcher's and sink's ``run`` loop), and Ray fails such a call the moment its actor dies. The
other roles — the parameter stores, the data loaders and each node's queue host (the actor holding
the queues between the roles, :mod:`megatrain_ray.orchestration.queues`) — sit idle between calls,
so a death there went unnoticed until the next call (the store's: the final export).
:class:`Health` keeps one small call in flight on each of them too (a ping, sent again half a
second after the last answer), and:

- a ping that fails means the role died: :class:`~megatrain_ray.errors.ActorDied`, naming the role
  (the driver restarts the pipeline from the newest checkpoint, up to cluster.max_restarts times);
- a ping unanswered for cluster.health_timeout_s means the role hangs (an idle role answers in
  milliseconds), and a busy role whose process on this node is stopped (SIGSTOP, a debugger) or a
  zombie hangs too (a debugger's brief tracing stop does not count): also ActorDied, naming the role and its process id, so the run restarts rather
  than waiting for a queue timeout of minutes (cluster.actor_timeout_s).

A role busy in a long call cannot answer a ping (one call at a time), so its liveness is that
call's; whether it makes progress is told by the queues: each node's queue host is asked, instead
of a plain ping, how long ago it last moved an item and who waits on which queue
(:meth:`~megatrain_ray.orchestration.queues.QueueHost.progress`). No item moved for ``stall_s``
(:func:`~megatrain_ray.orchestration.pace.stall_s`: a few expected step times) is the evidence of
a stall: ActorDied again, saying who waits for what. This is the only place a run is called
stalled; the roles' own waits last while items move anywhere on their node (a slow step is no stall).
"""

from __future__ import annotations

import os
import time

import ray

from ..errors import ActorDied
from . import cluster
from .calls import get as _get
from .calls import get_started, ray_logs


def _whereami(actor) -> tuple[int, str]:
    """(process id, Ray node id) of the actor it runs in (called through ``__ray_call__``)."""
    return os.getpid(), ray.get_runtime_context().get_node_id()


class Health:
    """See the module docstring. ``idle``/``busy``: role name -> actor handle (the queue hosts are idle roles)."""

    INTERVAL_S = 0.5
    PROBE_S = 2.0
    """How often the GCS and the raylet are asked for a connection (:func:`~megatrain_ray.orchestration.cluster.lost`)."""
    probed = 0.0

    def __init__(self, idle: dict, busy: dict, timeout_s: float, start_timeout_s: float,
                 stall_s: float | None = None, hosts: set[str] = frozenset()):
        """``start_timeout_s``: how long a role may take to come up and say where it runs (cluster.start_timeout_s);
        ``hosts``: the idle roles that are queue hosts, whose queues moving no item for ``stall_s`` is a stall."""
        self.timeout_s = timeout_s
        self.stall_s, self.hosts = stall_s, set(hosts)
        self.idle = dict(idle)
        handles = {**self.idle, **busy}
        refs = {name: h.__ray_call__.remote(_whereami) for name, h in handles.items()}
        where = {name: get_started(ref, name, start_timeout_s) for name, ref in refs.items()}
        here = ray.get_runtime_context().get_node_id()
        self.pids = {name: pid for name, (pid, node) in where.items() if node == here}
        """role -> process id, for the roles on this node (their processes can be inspected here)."""
        self.busy = [name for name in busy if name in self.pids]
        self.pings: dict[str, tuple] = {}
        """role -> (ping ref, time sent)."""
        self.answered: dict[str, float] = {}
        """role -> when its last ping was answered."""
        self.started = time.monotonic()
        """Quiet queues count from here: the roles' start-up before it is no stall."""

    def check(self) -> None:
        """Raise ActorDied naming the first role found dead or hung; else send the pings that are due."""
        now = time.monotonic()
        if now - self.probed >= self.PROBE_S:  # Ray itself: its GCS and this node's raylet
            self.probed = now
            gone = cluster.lost()
            if gone:
                raise cluster.lost_error(gone)
        for name, (ref, sent) in list(self.pings.items()):
            done, _ = ray.wait([ref], timeout=0)
            if done:
                answer = _get(ref, name, self.timeout_s)  # a dead role raises ActorDied here
                del self.pings[name]
                self.answered[name] = now
                if name in self.hosts:
                    self._check_progress(name, *answer)
            elif now - sent > self.timeout_s:
                raise ActorDied(f"the {name} actor has not answered a health check for {self.timeout_s:.0f} s, so it "
                                f"hangs{self._pid(name)}; see its stack in the Ray dashboard, or raise "
                                "cluster.health_timeout_s if it is only slow.")
        for name in self.busy:
            status = _status(self.pids[name])
            if status == "stopped":  # SIGSTOP, a debugger: alive, but it will not go on
                raise ActorDied(f"the {name} actor's process {self.pids[name]} is stopped, so the run cannot go on; "
                                f"see its log in the Ray dashboard or {ray_logs()}.")
            if status in ("zombie", "dead", "gone"):  # noticed before Ray reports the death
                raise ActorDied(f"the {name} actor died (its process {self.pids[name]} is {status}); see its log in "
                                f"the Ray dashboard or {ray_logs()}.")
        for name, handle in self.idle.items():
            if name not in self.pings and now - self.answered.get(name, 0.0) >= self.INTERVAL_S:
                ping = handle.progress if name in self.hosts else handle.health_ping  # (orchestration.labels)
                self.pings[name] = (ping.remote(), now)

    def _check_progress(self, host: str, quiet_s: float, waiting: list[tuple[str, str]]) -> None:
        """Raise ActorDied if the queues of ``host`` moved no item for ``stall_s``: the run is stalled."""
        quiet_s = min(quiet_s, time.monotonic() - self.started)
        if self.stall_s is None or quiet_s < self.stall_s:
            return
        node = host.partition("@")[2]
        waits = ", ".join(_WAITS.get((queue.rsplit("-", 1)[0] if queue[-1].isdigit() else queue, op),
                                     f"{op} on {queue}") for queue, op in waiting) or "no role waits on a queue"
        raise ActorDied(f"the pipeline{f' of node {node}' if node else ''} is stalled: no message moved between its "
                        f"roles for {quiet_s:.0f} s ({self.stall_s:.0f} s is a few times the expected step time, or "
                        f"cluster.actor_timeout_s; see `megatrain-ray plan`), while {waits}; see the roles' stacks in "
                        "the Ray dashboard (or `ray stack`), or raise cluster.actor_timeout_s if a step may pass that "
                        "long without one.")

    def _pid(self, name: str) -> str:
        return f" (process {self.pids[name]})" if name in self.pids else ""


_WAITS = {("grad", "get"): "the gradient sink waits for a gradient",
          ("fetch", "get"): "the compute worker's loader waits for a fetch ticket",
          ("release", "get"): "the prefetcher waits for a free device slot",
          ("fetch", "put"): "the prefetcher waits for room in the fetch queue",
          ("release", "put"): "the compute worker waits to hand a slot back",
          ("grad-slots", "get"): "the compute worker waits for a free gradient slot"}
"""What a call waiting on a queue (its name without the worker number, get or put) says of its role."""


def _status(pid: int) -> str:
    """A process's state as /proc tells it (running, sleeping, stopped, zombie, ...), or ``gone``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return {"R": "running", "S": "sleeping", "D": "disk-sleep", "T": "stopped", "t": "tracing-stop",
            "Z": "zombie", "X": "dead", "I": "idle"}.get(state, state)
