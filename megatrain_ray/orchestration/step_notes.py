"""A line while a long step runs: the driver waits for a step's result, and every
:data:`~megatrain_ray.progress.NOTE_EVERY_S` seconds of that wait it says how far the step is:
``still on step 4/60: 30 s so far, 23 of 60 weight units through the compute worker`` (a line of its
own kind: the step's own line, ``step 4/60 | loss ...``, follows when it ends).

The units are those the (first) compute worker took off its fetch queue (the store's units, each a
decoder layer, the embedding or the head, forward and backward: the step's ``fetches``), counted by
the node's queue host (:meth:`~megatrain_ray.orchestration.queues.QueueHost.taken`) from where the
step before ended. So that short steps cost no call, the count where a step ended is read only after
a step long enough for a line (the first step counts from the start); else the line gives the time alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..progress import NOTE_EVERY_S


class StepNotes:
    """See the module docstring. ``fetch_q``: the first compute worker's fetch queue (a
    :class:`~megatrain_ray.orchestration.queues.QueueClient`), or None (time alone)."""

    def __init__(self, log: Callable[[str], None], steps: int, fetch_q=None, every_s: float = NOTE_EVERY_S):
        self.log, self.steps, self.fetch_q, self.every_s = log, steps, fetch_q, every_s
        self.base: int | None = 0
        """Units taken off the fetch queue where the step waited for began (None: unknown)."""
        self.units: int | None = None
        """Units of a step (the last step's fetches), None before one ended."""
        self.waiting_for: int | None = None
        self.since = self.next_note = 0.0

    def waiting(self, step: int) -> None:
        """The driver still waits for ``step`` (0-based): a line when one is due."""
        now = time.monotonic()
        if step != self.waiting_for:
            self.waiting_for, self.since, self.next_note = step, now, now + self.every_s
            return
        if now < self.next_note:
            return
        self.next_note = now + self.every_s
        self.log(f"still on step {step + 1}/{self.steps}: {now - self.since:.0f} s so far{self._units()}")

    def ended(self, out: dict) -> None:
        """A step's result came (its ``fetches``, ``step_s``)."""
        self.units = sum(out.get("fetches", {}).values()) or None
        self.base = None
        if out.get("step_s", 0.0) >= max(self.every_s / 3, 1.0):  # steps long enough for a line: count from here
            self.base = self._taken()

    def _taken(self) -> int | None:
        if self.fetch_q is None:
            return None
        try:
            return self.fetch_q.taken(within=5.0)
        except Exception:  # noqa: BLE001 (a slow or dead queue host: the line gives the time alone)
            return None

    def _units(self) -> str:
        if self.base is None:
            return ""
        taken = self._taken()
        if taken is None:
            return ""
        total = f" of {self.units}" if self.units else ""
        return f", {taken - self.base}{total} weight units through the compute worker"
