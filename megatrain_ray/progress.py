"""What a run says while it waits: a line every so often during a long wait (Ray starting, the data
tokenizing, a long step), and the remaining time of the run from the pace of its recent steps.

:func:`still` runs a small thread beside a blocking call (``ray.init``, Ray Data's tokenizer pool)
that logs ``<what>: <N> s so far...`` every ``every_s`` seconds until the call returns; the thread
ends with the block. :class:`Eta` gives the time left: the mean pace of the last :data:`ETA_STEPS`
steps times the steps left, where a step's pace is the longer of the time since the step before it
ended (the pipeline's period) and its own run time on the compute worker (two steps in flight can end
moments apart, a period that says nothing of the pace: the run time keeps it honest).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator

NOTE_EVERY_S = 15.0
"""Seconds between two lines of a wait that goes on (:func:`still`, a long step)."""

ETA_STEPS = 20
"""Steps whose pace the time left is the mean of (:class:`Eta`)."""


@contextlib.contextmanager
def still(log: Callable[[str], None], what: str, every_s: float = NOTE_EVERY_S,
          detail: Callable[[], str] | None = None) -> Iterator[None]:
    """While the block runs, every ``every_s`` seconds the line ``<what>: <N> s so far<detail()>``
    (``detail``: more words, e.g. ``, 3 of 8 blocks``; it must not raise). The thread is joined when
    the block ends, however it ends."""
    done = threading.Event()
    start = time.monotonic()

    def tick() -> None:
        while not done.wait(every_s):
            log(f"{what}: {time.monotonic() - start:.0f} s so far{detail() if detail else ''}")

    thread = threading.Thread(target=tick, name=f"still: {what}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


class Eta:
    """The time left of a run, smoothed over its recent steps (see the module docstring)."""

    def __init__(self, window: int = ETA_STEPS):
        self.paces: collections.deque[float] = collections.deque(maxlen=window)
        self.last_end: float | None = None

    def step(self, end: float, run_s: float) -> None:
        """A step ended at ``end`` (time.perf_counter) after ``run_s`` seconds on the compute worker
        (the first step's pace, compile and warm-up, is not counted: there is no end before it)."""
        if self.last_end is not None:
            self.paces.append(max(end - self.last_end, run_s))
        self.last_end = end

    def left_s(self, steps_left: int) -> float | None:
        """Seconds left for ``steps_left`` more steps; None before a step after the first was timed."""
        if not steps_left:
            return 0.0
        if not self.paces:
            return None
        return sum(self.paces) / len(self.paces) * steps_left
