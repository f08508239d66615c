"""Writing training checkpoints: the one writer, for the gradient sink's and the store actor's saves.

Every checkpoint of a run is written by a :class:`CheckpointWriter` over the run's host store, in
the format of :mod:`megatrain_ray.io.checkpoint` (its atomic temporary directory, checksummed files
and ``meta.json`` last). Its two triggers go through it:

- the gradient sink, every ``train.checkpoint_every`` steps and at the end: :meth:`CheckpointWriter.start`
  writes in the background while the sink goes on updating (below);
- the store actor, on an interrupt and before the final export with ``checkpoint_every=0``:
  :meth:`CheckpointWriter.save` waits for the boundary and writes in the foreground (nothing else
  runs then).

**A snapshot without pausing the sink.** A checkpoint is the store at a step boundary ``t``: every
unit has had exactly ``t`` updates. :meth:`~CheckpointWriter.start` checks that, then two threads
write the model shards and the optimizer shards straight from the store's shared memory, unit by
unit, in the order the sink will update the units in step ``t + 1``. The sink calls
:meth:`~CheckpointWriter.before_update` before it changes a unit: it returns at once if the unit's
tensors (master weights and both AdamW moments) are already written and checksummed, else it waits
until they are. So every unit is written exactly as it was at the boundary, the bytes a paused save
would write, without a copy of the store (no extra host memory); the sink waits only where the
disk falls behind it, and meanwhile the compute worker runs on (its gradients queue up).

**What that costs at 7B.** A checkpoint is 7.62e9 parameters x 12 bytes = 91.4 GB (fp32 master and
moments). The sink must change every unit once a step, so without a copy of the store the writer
has about one step (6.5 s on one H200; the first update of step ``t + 1`` comes after its forward
and backward) before the sink catches up with it, and the stall per checkpoint is about
``max(0, 91.4 GB / write rate - 6.5 s)``. A unit's bytes count as written once ``write()`` has
copied them to the page cache (each file is fsynced before the rename), but on the 7B box the run
holds ~103 of 128 GiB, so the page cache soon runs at the disk's rate. Within 5% of the time between
checkpoints at ``checkpoint_every=50`` (16 s of 325 s) takes ~4 GB/s (a fast NVMe); at 2 GB/s it
is ~39 s (12%), the paused save it replaces was ~46 s. Past that, only memory helps (a staging copy
of the units the disk has not reached). The CRC-32 costs 2.5-3.0 GB/s of one core (measured on a
2.8 GHz Xeon, per second of the thread's CPU time): ~34 core-seconds per 7B checkpoint, on the two
files' checksum threads beside the writes, 5-6 GB/s together, so it does not hold units back at
those disk rates. ``benchmarks/checkpoint_cost.py`` measures a machine's rates and prints this
estimate; each save's stall is reported (``stall_s``) in its notice on the stats queue and logged
by the driver.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..errors import CheckpointError
from ..model.transformer import hf_name
from .checkpoint import (FORMAT, FORMAT_VERSION, META_FILE, MODEL_INDEX, OPTIM_INDEX, OPTIM_KINDS, SHARD_BYTES,
                         CheckpointPlan, latest, prune, step_dir_name)
from .files import TensorSource, fmt_bytes, free_bytes, fsync_dir, write_json, write_shards


class CheckpointWriter:
    """Writes the checkpoints of one HostStore as ``plan`` says (see the module docstring)."""

    def __init__(self, store, plan: CheckpointPlan, shard_bytes: int = SHARD_BYTES):
        self.store, self.plan, self.shard_bytes = store, plan, shard_bytes
        self._thread: threading.Thread | None = None
        self._written: list[threading.Event] = []
        self._outcome: dict = {}
        self._stall_s = 0.0

    # -- the sink's side: in the background --------------------------------------------------

    def start(self, step: int, order: list[int] | None = None) -> None:
        """Begin writing the boundary after ``step`` updates in the background, the units in ``order``
        (the order of the sink's next updates; default: the layout's). A write still running is
        finished first (:meth:`finish`)."""
        self.finish()
        units = range(len(self.store.layout.units))
        self._check_boundary(step)
        self._written = [threading.Event() for _ in units]
        self._outcome, self._stall_s = {"step": step, "began": time.time()}, 0.0
        order = list(order) if order is not None else list(units)
        self._thread = threading.Thread(target=self._write_in_background, args=(step, order),
                                        name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def before_update(self, unit: int) -> None:
        """Return once ``unit``'s bytes of the checkpoint being written (if any) are on their way to
        disk, so the caller may change the unit. A write that failed releases every unit (its error
        is raised by :meth:`poll` or :meth:`finish`)."""
        if self._thread is None or self._written[unit].is_set():
            return
        began = time.perf_counter()
        self._written[unit].wait()
        self._stall_s += time.perf_counter() - began

    @property
    def busy(self) -> bool:
        """Whether a background write is still running."""
        return self._thread is not None and self._thread.is_alive()

    def poll(self) -> dict | None:
        """The notice of a background write that has completed since the last call ({checkpoint: path,
        step, save_s, stall_s}), None while one is running or none was started; its CheckpointError
        if it failed."""
        if self._thread is None or self._thread.is_alive():
            return None
        self._thread.join()
        self._thread = None
        outcome = self._outcome
        if "error" in outcome:
            raise outcome["error"]
        return {"checkpoint": outcome["path"], "step": outcome["step"], "save_s": outcome["done"] - outcome["began"],
                "stall_s": self._stall_s}

    def finish(self) -> dict | None:
        """Wait for the background write (if one is running); its notice as :meth:`poll` gives it."""
        if self._thread is not None:
            self._thread.join()
        return self.poll()

    def _write_in_background(self, step: int, order: list[int]) -> None:
        try:
            self._outcome["path"] = self._write(step, order, self._release)
        except BaseException as e:  # noqa: BLE001 (the sink raises it from poll/finish)
            self._outcome["error"] = e if isinstance(e, CheckpointError) else CheckpointError(
                f"could not write the checkpoint of step {step} to {self.plan.directory} ({e}).")
        finally:
            for event in self._written:  # a failed write holds no unit back
                event.set()
            self._outcome["done"] = time.time()

    def _release(self, unit: int) -> None:
        self._written[unit].set()

    # -- the store actor's side: in the foreground -------------------------------------------

    def save(self, step: int) -> str:
        """Write the boundary after ``step`` updates now and return its path, after waiting up to the
        plan's ``wait_s`` for every unit to reach it (on an interrupt, the sink is still applying the
        steps in flight)."""
        store, units = self.store, range(len(self.store.layout.units))
        deadline = time.monotonic() + self.plan.wait_s
        while (any(store.version(i) < step for i in units) and time.monotonic() < deadline
               and not any(store.version(i) > step for i in units)):
            time.sleep(0.01)
        self._check_boundary(step)
        return self._write(step, list(units), lambda unit: None)

    # -- both -----------------------------------------------------------------------------------

    def _check_boundary(self, step: int) -> None:
        store = self.store
        stale = {u: store.version(i) for i, u in enumerate(store.layout.units) if store.version(i) != step}
        if stale:
            names = list(stale)
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            raise CheckpointError(f"refusing to checkpoint step {step}: units {shown} are at versions "
                                  f"{sorted(set(stale.values()))}, so the store is not at a step boundary.")

    def _write(self, step: int, order: list[int], release: Callable[[int], None]) -> str:
        """Write the checkpoint (units' tensors in ``order``; ``release(unit)`` once a unit's last byte
        is written and checksummed), rename it into place and prune; returns its path."""
        root, plan, store = self.plan.directory, self.plan, self.store
        final = os.path.join(root, step_dir_name(step))
        if os.path.isdir(final):  # this run saved the boundary already
            for unit in order:
                release(unit)
            return final
        meta = self._meta(step)  # before any unit may change
        tmp = os.path.join(root, f".{step_dir_name(step)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        layout = store.layout
        left = {i: len(layout.templates[i].params) * (1 + len(OPTIM_KINDS)) for i in order}
        lock = threading.Lock()

        def written(unit: int) -> Callable[[], None]:
            def done() -> None:
                with lock:
                    left[unit] -= 1
                    last = left[unit] == 0
                if last:
                    release(unit)
            return done

        model = [TensorSource.of(hf_name(layout.units[i], name), store.params("master", i)[name], written(i))
                 for i in order for name, _, _ in layout.templates[i].params]
        optim = [TensorSource.of(f"{kind}.{hf_name(layout.units[i], name)}", store.params(kind, i)[name], written(i))
                 for i in order for name, _, _ in layout.templates[i].params for kind in OPTIM_KINDS]
        try:
            os.makedirs(tmp)
            with ThreadPoolExecutor(2) as pool:  # model and optimizer files side by side, unit by unit
                parts = [pool.submit(write_shards, tmp, "model", MODEL_INDEX, model, self.shard_bytes),
                         pool.submit(write_shards, tmp, "optimizer", OPTIM_INDEX, optim, self.shard_bytes)]
                records = {name: rec for part in parts for name, rec in part.result()[1].items()}
            hf = store.spec.model.to_hf_dict()
            hf["torch_dtype"] = str(store.spec.precision.master).removeprefix("torch.")
            records["config.json"] = write_json(os.path.join(tmp, "config.json"), hf)
            meta["files"] = {name: rec.to_dict() for name, rec in sorted(records.items())}
            write_json(os.path.join(tmp, META_FILE), meta)
            try:
                os.rename(tmp, final)
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST) and os.path.isdir(final):
                    shutil.rmtree(tmp, ignore_errors=True)  # saved concurrently at the same boundary
                    return final
                raise
            fsync_dir(root)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            last = latest(root, missing_ok=True)
            kept = f"the last good checkpoint, {last}, is intact" if last else "no earlier checkpoint exists"
            raise CheckpointError(f"could not write the checkpoint of step {step} to {root} "
                                  f"({e.strerror or e}); it needs {fmt_bytes(checkpoint_bytes(store))} and "
                                  f"{fmt_bytes(free_bytes(root))} is free there: free space or set runtime.run_dir "
                                  f"to a larger disk; {kept}.") from None
        finally:
            for unit in order:  # whatever happened, the units are free to change now
                release(unit)
        prune(root, plan.keep)
        return final

    def _meta(self, step: int) -> dict:
        """meta.json of the boundary ``step`` (its ``files`` added once they are written)."""
        store, plan = self.store, self.plan
        spec, units = store.spec, store.layout.units
        run_config = plan.run_config
        train = run_config.get("train", {})
        sequences = train.get("micro_batch_size", 0) * train.get("num_micro_batches", 0)
        data_state = dict(plan.data_state or {})
        order = data_state.pop("order", None)
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": step,
            "versions": {u: store.version(i) for i, u in enumerate(units)},
            "adamw_step": step,
            "data": {**data_state, "next_step": step, "path": run_config.get("data", {}).get("path"),
                     "sequences_consumed": step * sequences, "tokens_consumed": step * sequences * train.get("seq_len", 0)},
            "rng": {"seed": train.get("seed"),
                    "data_order": order or "unknown (the data loader recorded none)",
                    "torch": "not used after initialisation: the model has no dropout and the initial weights "
                             "are drawn per unit from torch.Generator(seed * 1000003 + unit index)",
                    "draws_after_init": 0},
            "precision": {"master": str(spec.precision.master).removeprefix("torch."), "optim_state": "float32"},
            "model": spec.model.to_hf_dict(),
            "config": run_config,
            "run_id": plan.run_id,
            "saved_at": time.time(),
        }


def save(store, root: str, step: int, run_config: dict, run_id: str = "", data_state: dict | None = None,
         shard_bytes: int = SHARD_BYTES, wait_s: float = 0.0) -> str:
    """Write the store (a HostStore at boundary ``step``) to ``root``/step-NNNNNN now; returns its path.

    A checkpoint outside any run's plan (tests, tools); nothing is pruned. If the directory exists
    already (this boundary was saved), nothing is written.
    """
    plan = CheckpointPlan(root, every=0, keep=0, run_config=run_config, run_id=run_id, data_state=data_state or {},
                          wait_s=wait_s)
    return CheckpointWriter(store, plan, shard_bytes).save(step)


def checkpoint_bytes(store) -> int:
    """Bytes of the tensors of a checkpoint of this store (headers and JSON files are noise)."""
    return store.layout.num_params * (store.spec.precision.master.itemsize + 4 * len(OPTIM_KINDS))
