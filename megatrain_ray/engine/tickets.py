"""Control messages of the pipeline (the order of their units: :mod:`megatrain_ray.engine.schedule`).

Queues between actors carry only these small tickets, never tensors: the bytes they refer to live
in the host store's shared memory (grad blocks) or in the compute worker's device slots. A role
waits for its next ticket with :func:`wait_while_moving`: as long as the pipeline around it makes
progress.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


NO_PROGRESS = ("a role makes no progress (see the health check's verdict, the roles' stacks in the Ray dashboard or "
               "`ray stack`), or raise cluster.actor_timeout_s if a step may pass that long without a message.")
"""The end of the sentence of a role whose wait found no progress anywhere (:func:`wait_while_moving`)."""


def wait_while_moving(attempt: Callable[[float], Any], q, timeout_s: float) -> Any:
    """``attempt(t)``: a wait of at most ``t`` seconds (a queue's get or put, a poll) that raises
    :class:`queue.Empty` or :class:`queue.Full`, or returns None, when it ends empty-handed; tried
    again while any queue of ``q``'s node moved an item within the last ``timeout_s``
    (``q.quiet_s()``, see :class:`~megatrain_ray.orchestration.queues.QueueHost`; a plain
    :class:`queue.Queue`, which cannot tell, counts as quiet). So a role gives up
    only after ``timeout_s`` without any progress between the roles, never because the message it
    waits for is merely slow; the exception (or None) of the last attempt is then the caller's."""
    left = timeout_s
    while True:
        try:
            out, empty = attempt(left), None
        except (queue.Empty, queue.Full) as e:
            out, empty = None, e
        if out is not None:
            return out
        quiet = q.quiet_s() if hasattr(q, "quiet_s") else timeout_s  # a plain queue.Queue cannot tell
        if quiet >= timeout_s:
            if empty is not None:
                raise empty
            return None
        left = max(timeout_s - quiet, 1e-3)


@dataclass(frozen=True)
class FetchTicket:
    """Prefetcher -> compute: stream ``unit``'s weights at version ``step`` into device slot ``slot``."""

    unit: int
    step: int
    slot: int
    refetch: bool = False
    """A later fetch of the unit in the step, not its first (:attr:`~megatrain_ray.engine.schedule.Schedule.refetch`):
    a sparse layer's copy moves only the parts the step's routing uses."""


@dataclass(frozen=True)
class GradTicket:
    """Compute -> sink: ``unit``'s gradient for ``step`` is complete in its host grad block."""

    unit: int
    step: int
    sq_norm: float
    """Squared L2 norm of the gradient, taken on the device in fp32."""
    slot: int = -1
    """The gradient ring's slot holding it, when the store has a ring (else -1: the unit's block)."""
    step_sq_norm: float = -1.0
    """With gradients held on the device (``StoreSpec.hold_grads``): the squared norm of the whole step's
    gradient, summed in the order the units' gradients were computed, so the sink can clip and update
    at once; else -1."""
    skipped: tuple[int, ...] = ()
    """Indices into the unit's :attr:`~megatrain_ray.model.layout.Unit.parts` whose gradient was not
    sent: routed experts no token of the step chose, whose gradient is zero; the sink zeroes their
    ranges of the gradient block before the update (:mod:`megatrain_ray.engine.experts`)."""


def drain(inbox: queue.Queue, stop) -> Iterator[Any]:
    """The items of a local outgoing queue until ``stop`` (a threading.Event) is set and it is empty."""
    while not stop.is_set() or not inbox.empty():
        try:
            yield inbox.get(timeout=0.2)
        except queue.Empty:
            continue
