"""A progress watchdog for the tokenizing step: a pool that lost an actor and makes no progress is stopped.

Ray Data's fixed-size actor pool keeps a tokenizer actor that died while idle as one of its
members (Ray 2.60): no work is sent to it and no replacement is started, so once no live actor
takes the remaining blocks the step waits forever without an error. :class:`TokenizeWatchdog`
makes that end in one sentence, whatever the pool does:

- the cache writer calls :meth:`~TokenizeWatchdog.beat` for each block it writes (an assignment);
- a thread of the watchdog wakes a few times per ``stall_s`` and, only once no block was written
  for ``stall_s`` (cluster.actor_timeout_s), asks Ray's GCS for the pool's actors that died during
  the step; a slow pool whose actors all live is left alone (a long block is no stall);
- a stall with a dead actor stops the step: the error is handed to the dataset's consumer and its
  executor is shut down with its actors killed, so the caller raises one sentence naming the
  step, the dead actor's process and what to do, and no actor or thread of the step is left.

The executors of the step are seen through a Ray Data execution callback (:class:`SeenExecutor`)
that the step registers on its DataContext while it runs; it also notes each actor their pools
start, so that a step ending in any error (a dead actor reported by Ray Data itself, say) kills
the pool's actors on the way out: Ray Data's own shutdown on an error only drops its handles, and
a busy actor would go on with its block.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from ray.data._internal.execution.execution_callback import ExecutionCallback

from ..errors import DataError

_WATCHING: list[TokenizeWatchdog] = []
"""The watchdogs of the tokenizing steps running in this process (the executors they stop)."""


class SeenExecutor(ExecutionCallback):
    """Hands each Ray Data executor that starts to the running watchdog (instantiated by Ray Data)."""

    def before_execution_starts(self, executor) -> None:
        for watchdog in list(_WATCHING):
            watchdog.executors.append(executor)

    def on_execution_step(self, executor) -> None:
        for watchdog in list(_WATCHING):
            watchdog.actors.update(_pool_actors(executor))


def _pool_actors(executor) -> dict:
    """The actors of an executor's actor pools now, pending or running, by id (attributes of Ray
    2.60's ActorPoolMapOperator and its pool; ray is pinned)."""
    found = {}
    for op in getattr(executor, "_topology", {}):
        pool = getattr(op, "_actor_pool", None)
        if pool is not None:
            for actor in [*getattr(pool, "_running_actors", {}), *getattr(pool, "_pending_actors", {}).values()]:
                found[actor._actor_id] = actor
    return found


def dead_pool_actors(class_name: str, since: float) -> list[int]:
    """The process ids of this job's actors named ``class_name`` (Ray Data names a pool's actors
    ``MapWorker(MapBatches(<class>))``) started at or after ``since`` (time.time()) that are dead."""
    import ray
    from ray._private import state

    job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    actors = state.actors(job_id=job, actor_state_name="DEAD")
    return sorted(int(a["Pid"]) for a in actors.values()
                  if a.get("ActorClassName") == class_name and a.get("StartTime", 0) >= since * 1000 - 1)


class TokenizeWatchdog:
    """See the module docstring. ``where`` names the data (``data.path '...'``); ``dead()`` lists the
    process ids of the pool's dead actors (:func:`dead_pool_actors`); ``clock``: time.monotonic."""

    def __init__(self, where: str, stall_s: float, dead: Callable[[], list[int]],
                 clock: Callable[[], float] = time.monotonic):
        self.where, self.stall_s, self.dead, self.clock = where, stall_s, dead, clock
        self.last = clock()
        """When the last block was written (or the step began)."""
        self.error: DataError | None = None
        """The sentence the step was stopped with, once it was."""
        self.executors: list = []
        self.actors: dict = {}
        """Every actor the step's pools started, by id (handles: see :class:`SeenExecutor`)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenize-watchdog", daemon=True)

    def beat(self) -> None:
        """A block was written to the cache."""
        self.last = self.clock()

    def check(self) -> DataError | None:
        """The error to stop the step with: no block written for ``stall_s`` and an actor of the
        pool dead; else None (the GCS is asked only once the step has been quiet that long)."""
        quiet = self.clock() - self.last
        if quiet < self.stall_s:
            return None
        pids = self.dead()
        if not pids:
            return None
        which = f"process {pids[0]}" if len(pids) == 1 else f"processes {', '.join(map(str, pids))}"
        return DataError(f"tokenizing {self.where} stalled: a tokenizer actor of its pool died ({which}) and no "
                         f"block was tokenized for {self.stall_s:g} s (cluster.actor_timeout_s), so the step was stopped "
                         "and nothing was cached; train again, which tokenizes the data anew.")

    def raise_if_stopped(self) -> None:
        if self.error is not None:
            raise self.error

    def __enter__(self) -> TokenizeWatchdog:
        _WATCHING.append(self)
        self._thread.start()
        return self

    def __exit__(self, failed, *exc) -> None:
        self._stop.set()
        self._thread.join()
        _WATCHING.remove(self)
        if failed is not None or self.error is not None:  # no actor of a failed step goes on with its block
            import ray

            for actor in self.actors.values():
                with contextlib.suppress(Exception):  # an actor already dead
                    ray.kill(actor)

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.stall_s / 4)):
            try:
                error = self.check()
            except Exception:  # noqa: BLE001 (the GCS not answering now: asked again next time)
                continue
            if error is not None:
                self.error = error
                for executor in list(self.executors):
                    _stop_executor(executor, error)
                return


def _stop_executor(executor, error: Exception) -> None:
    """Fail a Ray Data executor with ``error``: its consumer raises it (even where its scheduling loop
    no longer runs), and its operators are shut down with their actors killed (``force``). Both under
    the executor's shutdown lock, so that the consumer's own shutdown on the error (which kills no
    busy actor) comes after this one. Attributes of Ray 2.60's StreamingExecutor (ray is pinned)."""
    lock = getattr(executor, "_shutdown_lock", None) or contextlib.nullcontext()
    with lock:
        output = getattr(executor, "_output_node", None)
        if output is not None:
            output[1].mark_finished(error)
        executor.shutdown(force=True, exception=error)
