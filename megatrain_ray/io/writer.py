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
disk falls behind it, and meanwhile the compute worker runs on (its gradients queue up). With a
staging budget (``train.checkpoint_staging_gib``), a unit that no writer thread has begun yet is
instead copied (master and moments, one memcpy of its blocks) and the writer later writes it from
the copy: the sink then waits only for the copy, until the budget is spent.

**What that costs at 7B.** A checkpoint is 7.62e9 parameters x 12 bytes = 91.4 GB (fp32 master and
moments). The sink must change every unit once a step, so without a copy of the store the writer
has about one step (6.5 s on one H200; the first update of step ``t + 1`` comes after its forward
and backward) before the sink catches up with it, and the stall per checkpoint is about
``max(0, 91.4 GB / write rate - 6.5 s)``. A unit's bytes count as written once ``write()`` has
copied them to the page cache (each file is fsynced before the rename), but on the 7B box the run
holds ~103 of 128 GiB, so the page cache soon runs at the disk's rate. Within 5% of the time between
checkpoints at ``checkpoint_every=50`` (16 s of 325 s) takes ~4 GB/s (a fast NVMe); at 2 GB/s it
is ~39 s (12%), the paused save it replaces was ~46 s. Past that, only memory helps: with a staging
budget of S bytes the stall is about ``S / copy rate + max(0, (91.4 GB - S) / write rate - 6.5 s)``;
the whole checkpoint staged at ~10 GB/s of multi-threaded copy is ~9 s (3%), but needs 91 GB of RAM
beyond the run's ~103 GiB (the 2-GPU 256 GiB box has it, the 128 GiB one does not).

**Checksums.** The CRC-32 costs 2.5-3.0 GB/s of one core (measured on a
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
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from ..errors import CheckpointError
from ..model.transformer import hf_name
from .checkpoint import (FORMAT, FORMAT_VERSION, META_FILE, MODEL_INDEX, OPTIM_INDEX, SHARD_BYTES, CheckpointSettings,
                         latest, meta_checksum, prune, step_dir_name)
from .files import TensorSource, fmt_bytes, free_bytes, fsync_dir, write_json, write_shards
from .state_tensors import optim_entries, optim_state_name, optim_tensors_of, state_block, state_kinds

GROUPS = ("model", "optim")
"""The groups of kinds each writer thread writes: the model files' (master) and the optimizer files'
(:func:`~megatrain_ray.io.state_tensors.state_kinds`). A unit's group is released (or staged) as a
whole, by the thread that writes it."""


class CheckpointWriter:
    """Writes the checkpoints of one HostStore as ``checkpoints`` says (see the module docstring)."""

    def __init__(self, store, checkpoints: CheckpointSettings, shard_bytes: int = SHARD_BYTES):
        self.store, self.checkpoints, self.shard_bytes = store, checkpoints, shard_bytes
        self.kinds = {"model": ("master",), "optim": state_kinds(store)}
        """The store kinds of each group."""
        self._thread: threading.Thread | None = None
        self._written: dict[tuple[int, str], threading.Event] = {}
        """(unit, group of kinds, see GROUPS) -> set once those tensors of the unit are written."""
        self._outcome: dict = {}
        self._stall_s = 0.0
        self._lock = threading.Lock()
        self._started: set[tuple[int, str]] = set()
        """(unit, group) a writer thread has begun to read from the store (too late to stage them)."""
        self._staged: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        """(unit, group) -> {kind: copy of the unit's flat block}, taken by before_update while the budget lasts."""
        self._staged_bytes = 0
        self._order: list[int] = []
        self._held: tuple[int, ...] = ()
        """The units whose host copy the compute worker holds for the write being made (see :meth:`start`)."""

    # -- the sink's side: in the background --------------------------------------------------

    def start(self, step: int, order: list[int] | None = None, held: tuple[int, ...] = ()) -> None:
        """Begin writing the boundary after ``step`` updates in the background, the units in ``order``
        (the order of the sink's next updates; default: the layout's). A write still running is
        finished first (:meth:`finish`). ``held``: the units whose host copy the compute worker
        holds for this write (the checkpoint copy, :mod:`megatrain_ray.engine.compute.resident`),
        released once they are written."""
        self.finish()
        self._held = tuple(held)
        units = range(len(self.store.layout.units))
        self._check_boundary(step)
        self._written = {(i, group): threading.Event() for i in units for group in GROUPS}
        self._outcome, self._stall_s = {"step": step, "began": time.time()}, 0.0
        self._started, self._staged, self._staged_bytes = set(), {}, 0
        order = self._order = list(order) if order is not None else list(units)
        self._thread = threading.Thread(target=self._write_in_background, args=(step, order),
                                        name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def before_update(self, unit: int) -> None:
        """Return once ``unit``'s bytes of the checkpoint being written (if any) are on their way to
        disk, so the caller may change the unit. A write that failed releases every unit (its error
        is raised by :meth:`poll` or :meth:`finish`)."""
        if self._thread is None:
            return
        began = time.perf_counter()
        for group in GROUPS:
            written = self._written[unit, group]
            if not written.is_set() and not self._stage(unit, group):
                self._stage_ahead(unit, group)  # the writer is on this unit: copy the ones it has not reached
                written.wait()
        self._stall_s += time.perf_counter() - began

    def _stage_ahead(self, unit: int, group: str) -> None:
        """Stage the units after ``unit`` in the write order that the writer has not begun, while the
        budget lasts (the caller will need them next, and the writer is behind)."""
        for later in self._order[self._order.index(unit) + 1:]:
            if (later, group) in self._staged or self._written[later, group].is_set():
                continue
            if not self._stage(later, group) and (later, group) not in self._started:
                return  # the budget is spent

    def _stage(self, unit: int, group: str) -> bool:
        """Copy a unit's group of kinds that its writer thread has not begun into the staging budget;
        False if it cannot be."""
        nbytes = sum(state_block(self.store, kind, unit).nbytes for kind in self.kinds[group])
        with self._lock:  # a writer thread reads a unit's group either from the store or from its copy, never both
            if (unit, group) in self._staged:
                return True
            if (unit, group) in self._started or self._staged_bytes + nbytes > self.checkpoints.staging_bytes:
                return False
            self._staged[unit, group] = {kind: state_block(self.store, kind, unit).clone()
                                         for kind in self.kinds[group]}
            self._staged_bytes += nbytes
        return True

    def _tensor(self, kind: str, unit: int, name: str | None) -> torch.Tensor:
        """A writer thread's read of one tensor of the boundary (parameter ``name``, or None: the unit's
        whole block): the unit's staged copy if it has one, else the store (and the unit can no longer
        be staged)."""
        key = (unit, "model" if kind == "master" else "optim")
        with self._lock:
            staged = self._staged.get(key)
            if staged is None:
                self._started.add(key)
                block = state_block(self.store, kind, unit)
        if staged is not None:
            block = staged[kind]
        return block if name is None else self.store.layout.templates[unit].bind(block)[name]

    @property
    def busy(self) -> bool:
        """Whether a background write is still running."""
        return self._thread is not None and self._thread.is_alive()

    def poll(self) -> dict | None:
        """The notice of a background write that has completed since the last call ({checkpoint: path,
        step, save_s, stall_s, staged_bytes}), None while one is running or none was started; its CheckpointError
        if it failed."""
        if self._thread is None or self._thread.is_alive():
            return None
        self._thread.join()
        self._thread = None
        outcome = self._outcome
        if "error" in outcome:
            raise outcome["error"]
        return {"checkpoint": outcome["path"], "step": outcome["step"], "save_s": outcome["done"] - outcome["began"],
                "stall_s": self._stall_s, "staged_bytes": outcome.get("staged_bytes", 0)}

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
                f"could not write the checkpoint of step {step} to {self.checkpoints.directory} ({e}).")
        finally:
            for event in self._written.values():  # a failed write holds no unit back
                event.set()
            self._release_resident(step)
            self._outcome["done"] = time.time()

    def _release(self, unit: int, group: str) -> None:
        self._written[unit, group].set()
        held = self._held
        if unit in held and all(self._written[u, g].is_set() for u in held for g in GROUPS):
            self._release_resident(self._outcome["step"])

    def _release_resident(self, step: int) -> None:
        """Let the compute worker overwrite the copy of its units that it held for this write
        (:mod:`megatrain_ray.engine.compute.resident`); a checkpoint copy of a later boundary is not this write's."""
        if self._held and self.store.checkpoint_copy() == step:
            self.store.set_checkpoint_copy(None)

    # -- the store actor's side: in the foreground -------------------------------------------

    def save(self, step: int) -> str:
        """Write the boundary after ``step`` updates now and return its path, after waiting up to the
        settings' ``wait_s`` for every unit to reach it (on an interrupt, the sink is still applying the
        steps in flight)."""
        store, units = self.store, range(len(self.store.layout.units))
        store.wait_until(lambda: all(store.state_version(i) >= step for i in units)
                         or any(store.state_version(i) > step for i in units), self.checkpoints.wait_s, pause=0.01)
        self._check_boundary(step)
        return self._write(step, list(units), lambda unit, group: None)

    # -- both -----------------------------------------------------------------------------------

    def _check_boundary(self, step: int) -> None:
        store = self.store
        gone = driver_gone(store.spec)
        if gone:
            raise CheckpointError(f"refusing to checkpoint step {step}: {gone}.")
        at = {u: store.state_version(i) for i, u in enumerate(store.layout.units)}
        stale = {u: v for u, v in at.items() if v != step}
        if stale:
            names = list(stale)
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            raise CheckpointError(f"refusing to checkpoint step {step}: units {shown} are at versions "
                                  f"{sorted(set(stale.values()))}, so the store is not at a step boundary.")

    def _write(self, step: int, order: list[int], release: Callable[[int, str], None]) -> str:
        """Write the checkpoint (units' tensors in ``order``; ``release(unit, group)`` once the last byte
        of a unit's group of kinds is written and checksummed), rename it into place and prune; returns
        its path."""
        root, checkpoints, store = self.checkpoints.directory, self.checkpoints, self.store
        final = os.path.join(root, step_dir_name(step))
        if os.path.isdir(final):  # this run saved the boundary already
            for unit in order:
                for group in GROUPS:
                    release(unit, group)
            return final
        meta = self._meta(step)  # before any unit may change
        tmp = os.path.join(root, f".{step_dir_name(step)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        layout = store.layout
        optim_keys = optim_entries(store, order)
        left = {(i, "model"): len(layout.templates[i].params) for i in order}
        for _, _, i, _ in optim_keys:
            left[i, "optim"] = left.get((i, "optim"), 0) + 1
        lock = threading.Lock()

        def written(unit: int, group: str) -> Callable[[], None]:
            def done() -> None:
                with lock:
                    left[unit, group] -= 1
                    last = left[unit, group] == 0
                if last:
                    release(unit, group)
            return done

        def source(key: str, kind: str, i: int, name: str | None) -> TensorSource:
            view = state_block(store, kind, i) if name is None else store.params(kind, i)[name]  # shape, dtype
            return TensorSource(key, tuple(view.shape), view.dtype, lambda: self._tensor(kind, i, name),
                                written(i, "model" if kind == "master" else "optim"))

        model = [source(hf_name(layout.units[i], name), "master", i, name)
                 for i in order for name, _, _ in layout.templates[i].params]
        optim = [source(key, kind, i, name) for key, kind, i, name in optim_keys]
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
            meta["meta_crc32"] = meta_checksum(meta)
            write_json(os.path.join(tmp, META_FILE), meta)
            gone = driver_gone(store.spec)
            if gone:  # it died while this was written: the checkpoint is not published
                shutil.rmtree(tmp, ignore_errors=True)
                raise CheckpointError(f"dropped the checkpoint of step {step}: {gone}.")
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
                                  f"{fmt_bytes(free_bytes(root))} is free there: free space or set train.run_dir "
                                  f"to a larger disk; {kept}.") from None
        finally:
            for unit in order:  # whatever happened, the units are free to change now
                for group in GROUPS:
                    release(unit, group)
            with self._lock:
                self._outcome["staged_bytes"] = self._staged_bytes
                self._staged, self._staged_bytes = {}, 0
        prune(root, checkpoints.keep)
        return final

    def _meta(self, step: int) -> dict:
        """meta.json of the boundary ``step`` (its ``files`` added once they are written)."""
        store = self.store
        spec, units = store.spec, store.layout.units
        return step_meta(self.checkpoints, step, {u: store.state_version(i) for i, u in enumerate(units)}, spec.model,
                         {"master": str(spec.precision.master).removeprefix("torch."),
                          "optim_state": optim_state_name(store)})


def driver_gone(spec) -> str | None:
    """Why no checkpoint is written for the run of store ``spec`` any more: its driver (process
    ``spec.owner_pid`` on the machine ``spec.owner_host``) has ended, so nobody asked for one and the
    run's record of its steps (metrics.jsonl) stopped where the driver did; None while the driver
    lives, or where this process cannot tell (another machine, an owner not known)."""
    if not spec.owner_host or spec.owner_host != socket.gethostname():
        return None
    try:
        with open(f"/proc/{spec.owner_pid}/stat") as f:  # a zombie (killed, not yet reaped) is gone too
            if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                return None
    except (OSError, IndexError):
        try:
            os.kill(spec.owner_pid, 0)
            return None
        except PermissionError:
            return None
        except ProcessLookupError:
            pass
    return f"the run's driver (process {spec.owner_pid}) is gone, so its roles write no checkpoint it did not ask for"


def step_meta(checkpoints: CheckpointSettings, step: int, versions: dict[str, int], model, precision: dict) -> dict:
    """meta.json of a checkpoint of ``checkpoints``' run at boundary ``step`` (its ``files`` added once they
    are written): versions {unit: updates}, model (a ModelConfig), precision {master, optim_state}."""
    run_config = checkpoints.run_config
    train = run_config.get("train", {})
    sequences = train.get("micro_batch_size", 0) * train.get("num_micro_batches", 0)
    data_state = dict(checkpoints.data_state or {})
    order = data_state.pop("order", None)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "versions": versions,
        "adamw_step": step,
        "data": {**data_state, "next_step": step, "path": run_config.get("data", {}).get("path"),
                 "sequences_consumed": step * sequences,
                 "tokens_consumed": step * sequences * train.get("seq_len", 0)},
        "rng": {"seed": train.get("seed"),
                "data_order": order or "unknown (the data loader recorded none)",
                "torch": "not used after initialisation: the model has no dropout and the initial weights "
                         "are drawn per unit from torch.Generator(seed * 1000003 + unit index)",
                "draws_after_init": 0},
        "precision": precision,
        "model": model.to_hf_dict(),
        "config": run_config,
        "run_id": checkpoints.run_id,
        "saved_at": time.time(),
    }


def save(store, root: str, step: int, run_config: dict, run_id: str = "", data_state: dict | None = None,
         shard_bytes: int = SHARD_BYTES, wait_s: float = 0.0) -> str:
    """Write the store (a HostStore at boundary ``step``) to ``root``/step-NNNNNN now; returns its path.

    A checkpoint outside any run's settings (tests, tools); nothing is pruned. If the directory exists
    already (this boundary was saved), nothing is written.
    """
    checkpoints = CheckpointSettings(root, every=0, keep=0, run_config=run_config, run_id=run_id, data_state=data_state or {},
                          wait_s=wait_s)
    return CheckpointWriter(store, checkpoints, shard_bytes).save(step)


def checkpoint_bytes(store) -> int:
    """Bytes of the tensors of a checkpoint of this store (headers and JSON files are noise)."""
    state = sum(t.numel() * t.element_size() for _, t in optim_tensors_of(store))
    return store.layout.num_params * store.spec.precision.master.itemsize + state
