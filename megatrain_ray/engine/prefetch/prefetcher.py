"""The prefetcher: decides which unit's weights go into which device slot, and when.

One loop over the run: for every step, for every unit in the resolved run's fetch order
(:attr:`~megatrain_ray.engine.schedule.Schedule.fetch`),
take a free slot (slots come back from the compute worker on the release queue; there are
``buffer_depth`` of them, so it never runs more than that far ahead), wait until the unit's
version in the store equals the step (its previous update is complete), and put a
:class:`~megatrain_ray.engine.tickets.FetchTicket` on the fetch queue. The compute worker starts the copy
as soon as the ticket arrives, while it still computes the previous unit.
"""

from __future__ import annotations

import collections
import queue
import time

from ...errors import PipelineError
from ..store.host_store import HostStore, StoreSpec
from ..schedule import Schedule
from ..tickets import NO_PROGRESS, FetchTicket, wait_while_moving


class Prefetcher:
    """Plain class; made a Ray actor at spawn."""

    doing: tuple[int, int] | None = None
    """(step, unit) of the fetch ticket being issued: what the dashboard shows (orchestration.labels)."""

    def __init__(self, spec: StoreSpec, schedule: Schedule, buffer_depth: int, fetch_q, release_q, timeout_s: float):
        """schedule: the run's (:attr:`~megatrain_ray.orchestration.resolve.ResolvedRun.schedule`), whose
        fetch order it issues every step."""
        self.store = HostStore(spec)
        self.units = self.store.layout.units
        self.order, self.refetch = schedule.fetch, schedule.refetch
        self.depth = buffer_depth
        self.fetch_q, self.release_q = fetch_q, release_q
        self.timeout_s = timeout_s
        self.version_wait_s = 0.0

    def run(self, start_step: int, end_step: int) -> dict:
        """Issue every fetch ticket of steps [start_step, end_step); returns wait statistics."""
        free = collections.deque(range(self.depth))
        issued = 0
        for step in range(start_step, end_step):
            for unit, refetch in zip(self.order, self.refetch):
                self.doing = (step, unit)
                if not free:
                    free.append(self._get(self.release_q, "a free device slot"))
                self._wait_version(unit, step)
                ticket = FetchTicket(unit, step, free.popleft(), refetch)
                wait_while_moving(lambda t: self.fetch_q.put(ticket, timeout=t) or True, self.fetch_q, self.timeout_s)
                issued += 1
        return {"issued": issued, "version_wait_s": self.version_wait_s}

    def _get(self, q, what: str):
        try:
            return wait_while_moving(lambda t: q.get(timeout=t), q, self.timeout_s)
        except queue.Empty:
            raise PipelineError(f"the prefetcher waited {self.timeout_s:.0f} s for {what} while no message moved "
                                f"between the roles; {NO_PROGRESS}") from None

    def _wait_version(self, unit: int, step: int) -> None:
        """Block until ``unit`` has received exactly ``step`` updates (polls shared memory)."""
        start = time.perf_counter()
        pause = [1e-4]

        def poll(within: float) -> bool | None:
            deadline = time.perf_counter() + within
            while self.store.version(unit) != step:
                if self.store.version(unit) > step:
                    raise PipelineError(f"{self.units[unit]} is at version {self.store.version(unit)}, "
                                        f"past step {step}: two pipelines share one store.")
                if time.perf_counter() > deadline:
                    return None
                time.sleep(pause[0])
                pause[0] = min(pause[0] * 2, 2e-3)
            return True

        if wait_while_moving(poll, self.fetch_q, self.timeout_s) is None:
            raise PipelineError(f"the prefetcher waited {self.timeout_s:.0f} s for the step-{step - 1} update of "
                                f"{self.units[unit]} while no message moved between the roles; {NO_PROGRESS}")
        self.version_wait_s += time.perf_counter() - start
