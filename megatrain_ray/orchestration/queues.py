"""The pipeline's queues on Ray: one queue-host actor per node and run holds all of that node's queues.

The roles of a node hand each other small items through named queues (see
:func:`~megatrain_ray.orchestration.roles.spawn_roles`):

====================  =================================================  ======================
queue                 items                                              bound
====================  =================================================  ======================
``fetch-W``           :class:`~megatrain_ray.engine.tickets.FetchTicket`  memory.buffer_depth
                      (prefetcher W -> compute worker W)
``release-W``         device slot ids, ``int`` (compute W -> prefetcher)  memory.buffer_depth
``grad``              :class:`~megatrain_ray.engine.tickets.GradTicket`   none
                      (compute workers -> sink)
``grad-slots``        free slots of the store's gradient ring, ``int``    none
                      (sink -> compute workers; only with a ring)
``stats``             ``dict``: a step's stats (step, grad_norm, lr,      none
                      ...) or a checkpoint notice (sink -> driver)
====================  =================================================  ======================

One ``ray.util.queue.Queue`` per queue would be one actor process each (4-5 per node and run,
each process start a second or two on a small machine); here :class:`QueueHost`, one async actor
with no CPU of its own, keeps each queue as an ``asyncio.Queue`` under its name, and
:class:`QueueClient` is the small picklable handle the roles hold: the host's actor handle, the
queue's name and bound. A client offers what the roles use of :class:`queue.Queue` (which the
single-process driver passes instead): ``put``/``get`` with ``block`` and ``timeout``, raising
:class:`queue.Full` / :class:`queue.Empty` when the time is up; and for the driver ``qsize`` and
``drain`` (everything waiting, in one call), each with a limit on the wait for the host's answer.
A call to a dead host raises :class:`~megatrain_ray.errors.ActorDied` naming the host (``queues``,
``queues@k``), in the driver and in the roles alike, so the run restarts from its newest checkpoint.

The host notes when it last moved an item on any of its queues: :meth:`QueueHost.quiet_s`, the
evidence of progress by which the roles keep waiting for a slow message
(:func:`~megatrain_ray.engine.tickets.wait_while_moving`) and the health check tells a stalled
pipeline from a slow one (:mod:`megatrain_ray.orchestration.health`, which also asks
:meth:`QueueHost.waiting` who waits for what).

A queue comes into being on the host with the first call that names it (every client of a name
carries the same bound), so no call has to wait for a "create" from the spawner to arrive first.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import time
from typing import Any


class QueueHost:
    """The queues of one node's pipeline, by name (an async Ray actor: a blocked ``get`` or ``put``
    waits on its event loop without holding up the other queues' calls)."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue] = {}
        self._moved = time.monotonic()
        """When an item last went onto or off one of the queues (the host's start before any)."""
        self._waiters: collections.Counter[tuple[str, str]] = collections.Counter()
        """(queue, "get" or "put") -> calls waiting there now."""
        self._taken: collections.Counter[str] = collections.Counter()
        """queue -> items taken off it so far (what a long step's progress line counts)."""

    async def quiet_s(self) -> float:
        """Seconds since an item last went onto or off any of this host's queues."""
        return time.monotonic() - self._moved

    async def waiting(self) -> list[tuple[str, str]]:
        """(queue, "get" or "put") of every call waiting now: on an empty queue or a full one."""
        return sorted(k for k, n in self._waiters.items() if n)

    async def progress(self) -> tuple[float, list[tuple[str, str]]]:
        """(:meth:`quiet_s`, :meth:`waiting`) in one call: what the health check asks twice a second."""
        return await self.quiet_s(), await self.waiting()

    async def _wait(self, name: str, op: str, awaitable, timeout: float | None):
        self._waiters[name, op] += 1
        try:
            async with asyncio.timeout(timeout):
                return await awaitable
        finally:
            self._waiters[name, op] -= 1

    def _queue(self, name: str, maxsize: int) -> asyncio.Queue:
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = asyncio.Queue(maxsize)
        return q

    async def put(self, name: str, maxsize: int, item: Any, timeout: float | None) -> bool:
        """Put ``item``, waiting up to ``timeout`` seconds (None: for ever) for room; False if there was none."""
        q = self._queue(name, maxsize)
        if not q.full():
            q.put_nowait(item)
            self._moved = time.monotonic()
            return True
        if timeout is not None and timeout <= 0:
            return False
        try:
            await self._wait(name, "put", q.put(item), timeout)
        except TimeoutError:
            return False
        self._moved = time.monotonic()
        return True

    async def get(self, name: str, maxsize: int, timeout: float | None) -> tuple[bool, Any]:
        """(True, the next item), waiting up to ``timeout`` seconds (None: for ever); (False, None) if none came."""
        q = self._queue(name, maxsize)
        if not q.empty():
            self._moved = time.monotonic()
            self._taken[name] += 1
            return True, q.get_nowait()
        if timeout is not None and timeout <= 0:
            return False, None
        try:
            item = await self._wait(name, "get", q.get(), timeout)  # a get cancelled by the timeout takes no item
        except TimeoutError:
            return False, None
        self._moved = time.monotonic()
        self._taken[name] += 1
        return True, item

    async def drain(self, name: str, maxsize: int) -> list:
        """Every item waiting, oldest first, without waiting for more."""
        q = self._queue(name, maxsize)
        if q.qsize():
            self._moved = time.monotonic()
        self._taken[name] += q.qsize()
        return [q.get_nowait() for _ in range(q.qsize())]

    async def size(self, name: str, maxsize: int) -> int:
        return self._queue(name, maxsize).qsize()

    async def taken(self, name: str, maxsize: int) -> int:
        """Items taken off the queue so far."""
        return self._taken[name]


class LocalQueue(queue.Queue):
    """A Python queue for the single-process driver that notes, on a clock its node's queues share
    (``moved``: a one-item list), when an item last went onto or off any of them, as
    :class:`QueueHost` does; ``quiet_s`` as :meth:`QueueClient.quiet_s`."""

    def __init__(self, maxsize: int, moved: list[float]):
        super().__init__(maxsize)
        self.moved = moved

    def _put(self, item) -> None:
        super()._put(item)
        self.moved[0] = time.monotonic()

    def _get(self):
        self.moved[0] = time.monotonic()
        return super()._get()

    def quiet_s(self) -> float:
        return time.monotonic() - self.moved[0]


class QueueClient:
    """One named queue of a :class:`QueueHost`, with the interface of :class:`queue.Queue` that the
    roles use (see the module docstring); picklable, so it is passed to the roles' constructors."""

    def __init__(self, host, name: str, maxsize: int = 0, role: str = "queues"):
        """``role``: the host's role name, which a dead host's error names."""
        self.host, self.name, self.maxsize, self.role = host, name, maxsize, role

    def _call(self, method: str, *args, within: float | None = None):
        import ray

        from .calls import actor_error

        try:
            return ray.get(getattr(self.host, method).remote(self.name, self.maxsize, *args), timeout=within)
        except ray.exceptions.RayActorError as e:  # the host died: ActorDied naming it, wherever the call was
            raise actor_error(e, self.role) from None

    @staticmethod
    def _wait(block: bool, timeout: float | None) -> float | None:
        if not block:
            return 0.0
        if timeout is not None and timeout < 0:
            raise ValueError("'timeout' must be a non-negative number")
        return timeout

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if not self._call("put", item, self._wait(block, timeout)):
            raise queue.Full

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        ok, item = self._call("get", self._wait(block, timeout))
        if not ok:
            raise queue.Empty
        return item

    def drain(self, within: float | None = None) -> list:
        """Every item waiting, oldest first, in one call to the host; ``within``: seconds to wait for
        its answer (None: for ever; then Ray's ``GetTimeoutError``)."""
        return self._call("drain", within=within)

    def quiet_s(self) -> float:
        """Seconds since any queue of this queue's host moved an item (:meth:`QueueHost.quiet_s`)."""
        import ray

        return ray.get(self.host.quiet_s.remote())

    def qsize(self, within: float | None = None) -> int:
        """Items waiting; ``within``: as for :meth:`drain`."""
        return self._call("size", within=within)

    def taken(self, within: float | None = None) -> int:
        """Items taken off the queue so far; ``within``: as for :meth:`drain`."""
        return self._call("taken", within=within)

    def __repr__(self) -> str:
        return f"QueueClient({self.name!r}, maxsize={self.maxsize})"
