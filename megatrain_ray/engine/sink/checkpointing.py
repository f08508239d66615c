"""The gradient sink's checkpoints: started at step boundaries, written beside the updates.

A checkpoint (when the sink is given a :class:`~megatrain_ray.io.checkpoint.CheckpointSettings`) is
started at the top of the sink's step loop, where every update of the previous step is done and
none of this step's has begun (a step boundary), and written in the background by a
:class:`~megatrain_ray.io.writer.CheckpointWriter` while the loop goes on: before each update the
sink waits only until that unit's bytes are written (:meth:`SinkCheckpoints.before_update`,
usually long since). The last boundary is saved after the loop, and waited for.

The units the compute worker updates (those resident on its device,
:mod:`megatrain_ray.engine.compute.resident`, copied into the store right after their update at a
checkpoint's boundary; and the streamed units updated on its device,
:mod:`megatrain_ray.engine.compute.device_updates`, written back after every update) have their
state versions set by the worker; the sink waits for them to say the boundary before it starts the
checkpoint, whose writer writes their bytes first and then lets the worker overwrite them.
"""

from __future__ import annotations

from ...errors import PipelineError
from ...io.writer import CheckpointWriter
from ..tickets import NO_PROGRESS, wait_while_moving


class SinkCheckpoints:
    """The checkpoints one gradient sink starts, writes and reports (see the module docstring)."""

    def __init__(self, store, checkpoints, writes: bool, stats_q, timeout_s: float, order: list[int],
                 resident: tuple[int, ...] = (), grad_q=None):
        """store: the sink's :class:`~megatrain_ray.engine.store.host_store.HostStore`; checkpoints: the run's
        CheckpointSettings or None; writes: whether this sink writes them (the first node's; the others
        only know the boundaries, see :mod:`megatrain_ray.engine.sink.shards`); order: the units in the
        order this step's updates will reach them; resident: the units the compute worker updates;
        grad_q: the sink's gradient queue (while messages move on it, the wait for the resident
        units' copy goes on)."""
        self.store, self.checkpoints, self.stats_q, self.timeout_s = store, checkpoints, stats_q, timeout_s
        self.writer = CheckpointWriter(store, checkpoints) if checkpoints is not None and writes else None
        self.order, self.resident, self.grad_q = order, resident, grad_q

    def due(self, step: int, start: int, end: int) -> bool:
        """Whether the boundary after ``step`` updates is a checkpoint's."""
        return self.checkpoints is not None and self.checkpoints.due(step, start, end)

    def start(self, step: int) -> None:
        """Start writing the boundary after ``step`` updates (a save still being written is finished
        first); the resident units' copy is awaited first, and written first."""
        self.report(wait=True)
        if self.writer is None:
            return
        self._await_resident(step)
        self.writer.start(step, [*self.resident, *self.order], held=self.resident)

    def before_update(self, unit: int) -> None:
        """Wait until the checkpoint being written has ``unit``'s bytes (the update will change them)."""
        if self.writer is not None:
            self.writer.before_update(unit)

    def report(self, wait: bool = False) -> None:
        """Put the notice of a completed save on the stats queue ({checkpoint: path, step, save_s,
        stall_s}); raise its error if it failed. ``wait``: for the save being written."""
        if self.writer is not None:
            notice = self.writer.finish() if wait else self.writer.poll()
            if notice is not None:
                self.stats_q.put(notice, timeout=self.timeout_s)

    def _await_resident(self, step: int) -> None:
        """Wait until the compute worker has copied the resident units' state of boundary ``step``
        into the store (:meth:`~megatrain_ray.engine.compute.resident.ResidentUnits.sync`)."""
        store = self.store

        def copied(within: float) -> bool | None:
            return store.wait_until(lambda: all(store.state_version(u) == step for u in self.resident), within) or None

        if wait_while_moving(copied, self.grad_q, self.timeout_s) is None:
            names = ", ".join(store.layout.units[u] for u in self.resident)
            raise PipelineError(f"the gradient sink waited {self.timeout_s:.0f} s for the compute worker's copy of "
                                f"{names} at step {step} while no message moved between the roles; {NO_PROGRESS}")
