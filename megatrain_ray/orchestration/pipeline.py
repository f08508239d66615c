"""``train()``: starts the actor pipeline on its node(s), runs the steps, restarts, always cleans up.

::

    DataLoader-k --batch refs--> driver --run_step(t, batch)--> ComputeWorker (one per GPU)
    ParameterStore (owns /dev/shm segments)         ^ fetch_q (FetchTicket, cap = buffer_depth)
    Prefetcher (one per worker) ------ fetch_q -----+       | release_q (slot ids)
        ^ polls unit versions in shared memory              | grad_q (GradTicket: a shard of the
    GradientSink <------------- grad_q ---------------------+   gradient summed over all workers)
        '-- stats_q (grad norm, lr) --> driver

The roles of every node are spawned and wired by :mod:`megatrain_ray.orchestration.roles` (a
node's queues are held by one actor, its queue host: :mod:`megatrain_ray.orchestration.queues`), the
step loop is :mod:`megatrain_ray.orchestration.driver`. The driver holds the long-running loop
calls of the prefetchers and sinks and waits on them together with each step, so the first actor
failure ends the run with an error naming the role. Whatever happens (success, exception, Ctrl-C,
SIGTERM), the placement groups, the actors and the stores' shared-memory segments are removed
before :func:`train` returns or raises.

The Ray it runs on (a running cluster, or a private one) is chosen by :mod:`megatrain_ray.orchestration.cluster`.
The run is resolved once (:func:`~megatrain_ray.orchestration.resolve.resolve`) before Ray starts,
and before anything is allocated :mod:`megatrain_ray.orchestration.preflight` checks that it fits
host RAM and memory.shm_dir. Checkpoints (:mod:`megatrain_ray.io.checkpoint`) are saved by the sink every
train.checkpoint_every steps and at the end; on Ctrl-C / SIGTERM (``ray job stop``) the driver stops
submitting steps, lets those in flight finish (a second signal skips this), and has the store
actor save the boundary they reach. ``train(cfg, resume=checkpoint_dir)`` loads one and runs the
steps [its step, train.steps) with the same schedule, so the result is bit-identical to an
uninterrupted run. Every step is a row of runs/<id>/metrics.jsonl and a set of Ray gauges
(:mod:`megatrain_ray.orchestration.metrics`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import socket
import time
import uuid
from typing import Any

import ray
import torch

from ..config import TrainConfig, describe_resident
from ..data.loader import check_resume_data, run_data, source_from_config
from ..engine.store import reaper, shm
from ..errors import ActorDied, ConfigError, Interrupted, MegatrainError, PipelineError  # noqa: F401  (Interrupted: raised by the driver)
from ..io import checkpoint, run_lock
from ..io.lora_checkpoint import check_adapters
from ..io.resume import continued_run
from ..model.flops import fmt_count
from ..model.layout import StoreLayout
from ..model.precision import resolve_device
from . import calls, cluster, console, metrics_file, preflight, trackers
from .calls import get as _get
from .cluster import connect_ray
from .device_memory import fmt, placement_line
from .driver import Driver, RunResult
from .health import Health
from .labels import loop_task
from .metrics import RunMetrics
from .pace import stall_s
from .resolve import Facts, ResolvedRun, check, resolve
from .roles import RaySpawner, place_cpus, spawn_roles
from .trackers import Trackers


class _Active:
    """The spawner of the pipeline now running and the run's trackers, so that every exit path can
    tear them down (the trackers' runs end FINISHED, KILLED when interrupted, else FAILED)."""

    def __init__(self) -> None:
        self.spawner: RaySpawner | None = None
        self.trackers: Trackers | None = None
        self.status = "FAILED"

    def close_trackers(self) -> None:
        if self.trackers is not None:
            self.trackers.close(self.status)
            self.trackers = None

    def dead(self, within: float = 3.0) -> MegatrainError | None:
        """The error of the first role found dead (an ActorDied naming it), every role asked at once;
        None if every one answers (or has not within ``within`` seconds: not known to be dead)."""
        handles = dict(self.spawner.handles) if self.spawner is not None else {}
        refs = {h.__ray_call__.remote(_answer): name for name, h in handles.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=within) if refs else ([], [])
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                return calls.actor_error(e, refs[ref])
        return None

    def kill(self) -> None:
        if self.spawner is not None and cluster.lost() is None:  # a Ray that is gone took the actors along
            self.spawner.kill()
        self.spawner = None


def _answer(actor) -> None:
    """What a role is asked to run (through ``__ray_call__``) to tell whether it lives."""


def train(cfg: TrainConfig, log=print, resume: str | None = None) -> RunResult:
    """Run optimizer steps [start, cfg.train.steps) through the actor pipeline; returns losses and paths.

    ``resume``: a checkpoint directory (see :func:`megatrain_ray.io.checkpoint.resume_config`); the
    run continues from its step, bit for bit, unless cfg changes the lr schedule (a larger
    train.steps extends a run: see :func:`megatrain_ray.io.checkpoint.check_resume`, whose sentence is
    logged). Ctrl-C and SIGTERM save a checkpoint, then raise :class:`Interrupted`. The run
    directory, and the one resumed from, are held for the process while it trains
    (:mod:`megatrain_ray.io.run_lock`): another process that would train or resume them is refused.
    Every line logged also goes to the run's log file (:mod:`megatrain_ray.orchestration.console`).
    """
    held = run_lock.acquire(run_lock.run_of(resume), "resuming") if resume is not None else None
    try:
        with console.console(log) as out:
            return _train(cfg, out, resume)
    finally:
        run_lock.release(held)


def _train(cfg: TrainConfig, log: console.Console, resume: str | None) -> RunResult:
    start_step, schedule_note = 0, None
    if cluster.starts_ray(cfg.cluster):  # a private Ray has this machine's GPUs: none is refused before it starts
        resolve_device(cfg.compute, torch.cuda.device_count())
    if resume is not None:  # nothing to resume is refused before the data is read
        meta = checkpoint.read_meta(resume)
        schedule_note = checkpoint.check_resume(meta, cfg, resume)
        check_adapters(meta, cfg.lora, resume)  # the adapters it holds, or none, against lora.*
        check_resume_data(meta.get("data") or {}, (meta.get("config") or {}).get("data") or {}, cfg, resume)
    # Read once: every attempt's loaders read this same data (fail on bad data before any actor starts).
    loader, source = run_data(cfg, log, connect_ray)
    val_batch = None
    if cfg.train.eval_every:  # the validation data too, read once for every attempt
        val_batch = source_from_config(cfg, "val", log, connect_ray).batch(0)
    if resume is None:
        preflight.check_init_from(cfg)
    else:
        checkpoint.check_model(meta, cfg.model, resume)
        checkpoint.check_files(resume)
        start_step = meta["step"]
        if hasattr(source, "resume_step") and "fingerprint" in meta.get("data", {}):
            source.resume_step(meta["data"])  # the same data, seed and batch shape
    cluster.check_num_workers(cfg)
    run = resolve(cfg, Facts.here(cfg, starts_ray=cluster.starts_ray(cfg.cluster)))
    check(run, log)
    trackers.check(cfg.train.loggers)  # a tracker's library missing: said before Ray starts
    # Installed before Ray (which sets its own SIGTERM handler), so SIGTERM unwinds like Ctrl-C.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    roles, spec, checkpoints, lease, own = _Active(), None, None, None, None
    try:
        cluster.connect(cfg.cluster, log)
        signal.signal(signal.SIGTERM, _raise_interrupt)
        device = resolve_device(cfg.compute, ray.cluster_resources().get("GPU", 0))
        if device != run.device:  # a cluster joined offers a device this process does not see
            run = resolve(cfg, Facts.here(cfg, device))
            check(run, log)
        # A resumed run continues its own directory (io.resume.continued_run), held by train() already.
        run_dir, branch = continued_run(resume, cfg.train.run_dir) if resume is not None else (None, "")
        in_place = run_dir is not None
        run_id = os.path.basename(run_dir) if run_dir else time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        spec = run.store_spec(os.getpid(), run_id, socket.gethostname())  # (whose death stops the checkpoints)
        for path in shm.remove_stale(cfg.memory.shm_dir):
            log(f"removed a stale shared-memory segment of a dead run: {path}")
        # If this process is killed (kill -9), the run's segments on this node (every attempt's) go at once.
        lease = reaper.start([shm.segment_path(spec.shm_dir, spec.owner_pid, run_id, "*")], [os.getpid()],
                             until_gone=False, lease=True)
        if run_dir is None:
            run_dir = os.path.abspath(os.path.join(cfg.train.run_dir, run_id))
            os.makedirs(run_dir, exist_ok=True)
            own = run_lock.acquire(run_dir, "training")
            log.attach(run_dir)
            log(f"run {run_id}: config, metrics, log, checkpoints and weights go to {run_dir}")
            if branch:
                log(f"resume: this run writes a run directory of its own, since {branch}; its config.json names "
                    f"the checkpoint (resumed_from), which `megatrain-ray plot` follows back")
        else:
            log.attach(run_dir)
            log(f"run {run_id}: continuing in {run_dir} (metrics, log and checkpoints go on where they are)")
            _rows_resumed(run_dir, start_step, log)  # steps past the checkpoint are trained again
        _write_run_config(run_dir, {**cfg.to_dict(), "device": device, "resolved": {"memory.resident": describe_resident(run.resident_layers)}},
                          resume, start_step, in_place)
        checkpoints = checkpoint.CheckpointSettings(os.path.join(run_dir, "checkpoints"), cfg.train.checkpoint_every,
                                         cfg.train.keep_checkpoints, cfg.to_dict(), run_id,
                                         _data_state(source), wait_s=cfg.cluster.actor_timeout_s,
                                         staging_bytes=int(cfg.train.checkpoint_staging_gib * 2**30))
        if resume is not None:
            log(f"resuming from {resume} at step {start_step}")
            if schedule_note:
                log(schedule_note)
        if cfg.train.loggers:
            roles.trackers = Trackers(cfg.train.loggers, run_dir, run_id, {**cfg.to_dict(), "device": device}, log)
        result = _attempts(run, spec, run_dir, roles, log, start_step, resume, checkpoints, loader, val_batch)
        roles.status = "FINISHED"
        return result
    except KeyboardInterrupt:
        roles.status = "KILLED"
        raise
    except MegatrainError as e:
        last = (checkpoints and checkpoint.latest(checkpoints.directory, missing_ok=True)) or resume
        if last is None or checkpoints is None or last in str(e):
            raise
        raise type(e)(f"{str(e).rstrip('.')}; the last good checkpoint is {last} "
                      f"({checkpoint.advice(last)}).") from None
    finally:
        roles.kill()
        if checkpoints is not None:  # a save its writer was still busy with when the roles went (after an interrupt's)
            checkpoint.remove_unfinished(checkpoints.directory)
        roles.close_trackers()
        if spec is not None:
            shm.remove_run(spec.shm_dir, spec.owner_pid, spec.run_id)
        if lease is not None:
            reaper.release(lease)
        run_lock.release(own)
        signal.signal(signal.SIGTERM, previous)


def _attempts(run: ResolvedRun, spec, run_dir: str, roles: _Active, log, start: int,
              resume: str | None, checkpoints: checkpoint.CheckpointSettings, loader: tuple,
              val_batch: dict | None = None) -> RunResult:
    """Run the pipeline; when an actor dies, restart it (up to cluster.max_restarts times) from the
    newest checkpoint of the run, or from where the run began if there is none yet.

    The store is never trusted after a death (a unit may be half-updated); a checkpoint is a step
    boundary and resuming from one is bit-exact, so the run ends with the weights of an unfaulted one.
    """
    cfg = run.config
    base_id = spec.run_id
    result = RunResult(run_id=os.path.basename(run_dir), run_dir=run_dir, final_dir=os.path.join(run_dir, "final"),
                       start_step=start)
    for attempt in range(cfg.cluster.max_restarts + 1):
        try:
            return _run(run, spec, run_dir, roles, log, loader, start, resume, checkpoints, val_batch, result)
        except PipelineError as failure:
            console.failed(log)  # Ray's reports of the failed attempt's unread calls: to the run's log only
            if calls.detail(failure):  # the traceback behind its sentence: to the run's log only
                console.keep(log, f"{failure}\n{calls.detail(failure)}")
            # A failure that followed from a death (a collective whose peer's node was lost, a fetch that a
            # dead queue host cut short) is that death: found by asking every role, and restarted like it.
            e = failure if isinstance(failure, ActorDied) else roles.dead()
            if not isinstance(e, ActorDied):
                raise
            gone = cluster.lost()
            if gone:  # the role died with Ray itself: nothing to restart on
                raise cluster.lost_error(gone) from None
            if attempt == cfg.cluster.max_restarts:
                raise e from None
            roles.kill()
            shm.remove_run(spec.shm_dir, spec.owner_pid, spec.run_id)
            resume = checkpoint.latest(checkpoints.directory, missing_ok=True) or resume
            start = checkpoint.read_meta(resume)["step"] if resume else 0
            unreported = _rewind(result, start)
            spec = dataclasses.replace(spec, run_id=f"{base_id}-r{attempt + 1}")
            log(f"restart {attempt + 1} of {cfg.cluster.max_restarts}: {str(e).rstrip('.')}; restarting the pipeline "
                f"from {resume or 'the initial weights'} (step {start}).")
            if unreported:
                which = (f"step {unreported[0] + 1} was" if len(unreported) == 1
                         else f"steps {unreported[0] + 1}-{unreported[-1] + 1} were")
                log(f"warning: {which} trained and in that checkpoint, but the stats (grad norm, lr) were lost with "
                    "the failed pipeline: metrics.jsonl has no rows for them.")
    raise AssertionError("unreachable")


def _rewind(result: RunResult, step: int) -> list[int]:
    """Forget what the run recorded from ``step`` on (the restart trains those steps again): the
    result's per-step lists and the rows of metrics.jsonl, so each step is reported once.

    The checkpoint restarted from may be ahead of the rows: the sink can save a boundary before the
    driver has its stats for the steps before it (the driver salvages what it can when a role dies,
    :meth:`~megatrain_ray.orchestration.driver.Driver._salvage`, but a dead queue host takes them
    along). Those steps are trained and kept; their rows are left out, their entries in the per-step
    lists are NaN where unknown. Returns those steps."""
    keep = step - result.start_step
    result.restarts += 1
    result.repeated_steps += max(0, len(result.losses) - keep)
    unreported = list(range(result.start_step + len(result.grad_norms), step))
    for values, blank in ((result.losses, math.nan), (result.fetches, {}), (result.grad_norms, math.nan)):
        del values[keep:]
        values.extend([blank] * (keep - len(values)))
    result.val_losses = {s: v for s, v in result.val_losses.items() if s < step}
    metrics_file.drop_rows(result.run_dir, step)
    return unreported


def _rows_resumed(run_dir: str, step: int, log) -> None:
    """Before a run resumed in place at ``step`` goes on: drop the rows of the steps it trains again
    (and a row its driver was killed while writing), and name the steps up to ``step`` that have no
    row (trained, and in the checkpoint, after the driver that would have written them was gone)."""
    if metrics_file.drop_rows(run_dir, step):
        log(f"resume: left out the last line of {os.path.join(run_dir, metrics_file.NAME)}, which was cut short "
            "(the run was stopped while writing it)")
    missing = metrics_file.missing_steps(run_dir, _first_step(run_dir), step)
    if missing:
        which = f"step {missing[0]} has" if len(missing) == 1 else f"steps {metrics_file.step_ranges(missing)} have"
        log(f"warning: {which} no row in metrics.jsonl: trained and in the checkpoint of step {step}, but their "
            "stats (loss, grad norm, lr) were lost with the process that ran them.")


def _first_step(run_dir: str) -> int:
    """The step a run directory's first session began from: 0, or its resumed_from checkpoint's step."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            start = json.load(f).get("resumed_from")
        return checkpoint.read_meta(start)["step"] if start else 0
    except (OSError, ValueError, AttributeError, KeyError, TypeError, MegatrainError):
        path = os.path.join(run_dir, metrics_file.NAME)  # that checkpoint is gone: from the first row there is
        rows = metrics_file.read(path)[0] if os.path.exists(path) else []
        return min((int(r["step"]) - 1 for r in rows), default=0)


def _write_run_config(run_dir: str, config: dict, resume: str | None, step: int, in_place: bool) -> None:
    """runs/<id>/config.json: the run's config as this process trains it; a run resumed in place lists
    every resume (``resumed``: checkpoint and step), one resumed into a directory of its own names its
    checkpoint (``resumed_from``)."""
    path = os.path.join(run_dir, "config.json")
    earlier = {}
    if in_place:
        try:
            with open(path) as f:
                earlier = json.load(f)
        except (OSError, ValueError):  # unreadable: this process's config, with this resume alone
            earlier = {}
    elif resume is not None:
        earlier = {"resumed_from": resume}
    kept = {k: earlier[k] for k in ("resumed_from",) if k in earlier}
    resumed = [*(earlier.get("resumed") or []), *([{"checkpoint": resume, "step": step}] if in_place else [])]
    with open(path, "w") as f:
        json.dump({**config, **kept, **({"resumed": resumed} if resumed else {})}, f, indent=2)


def _data_state(source) -> dict:
    """The loader's position record without its step (each checkpoint adds its own next_step)."""
    state = source.state(0) if hasattr(source, "state") else {}
    return {**{k: v for k, v in state.items() if k != "next_step"}, "order": getattr(source, "ORDER", None)}


def _start_line(spec, resume: str | None, init_from: str | None, nodes: int) -> str:
    """What the start-up does before the first step: the store's size and where its weights come from
    (a 100B model's take minutes to draw or read)."""
    base = init_from or "random weights (train.seed)"
    weights = (f"the checkpoint {resume}" if resume and not spec.lora.enabled
               else f"{base}, the adapters from the checkpoint {resume}" if resume else base)
    per_node = " on each node" if nodes > 1 else ""
    return (f"starting the roles: the store fills {fmt(spec.nbytes())} of {spec.shm_dir}{per_node} with "
            f"{fmt_count(StoreLayout.build(spec.model).num_params)} parameters from {weights}")


def _raise_interrupt(signum, frame):
    # A repeated SIGTERM (GNU timeout signals the driver and then its group; a scheduler may repeat
    # it) waits for the interrupt's checkpoint; the run's end restores the handler.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signum}")


def _run(run: ResolvedRun, spec, run_dir: str, active: _Active, log, loader: tuple, start: int = 0,
         resume: str | None = None, checkpoints: checkpoint.CheckpointSettings | None = None,
         val_batch: dict | None = None, result: RunResult | None = None) -> RunResult:
    """One attempt: spawn the roles of ``run`` (its store: ``spec``) and drive steps [start,
    train.steps); ``loader``: the run's data loader spec (:func:`~megatrain_ray.data.loader.run_data`);
    ``result``: what earlier attempts recorded (see :func:`_rewind`), added to."""
    cfg, device = run.config, run.device
    calls.mark_oom_kills()
    nodes = cfg.parallel.nodes
    specs = [spec] if nodes == 1 else [dataclasses.replace(spec, run_id=f"{spec.run_id}-n{k}") for k in range(nodes)]
    timeout, start_s = run.call_timeout_s, cfg.cluster.start_timeout_s
    active.spawner = spawner = RaySpawner(cfg, device, spec.run_id, lambda ref, role: calls.get_started(ref, role, start_s))
    log(_start_line(spec, resume, cfg.train.init_from, nodes))
    began = time.time()
    roles = spawn_roles(run, specs, spawner, resume, checkpoints, loader)
    log(f"roles started in {time.time() - began:.0f} s")
    spawner.form_group(roles.computes, run.call_timeout_s)
    spawner.form_shards([n.sink for n in roles.nodes])
    place_cpus(run, roles, spawner.get, log)
    log(placement_line(roles.activations, device, cfg.memory.activations))
    log(roles.pace.line())
    steps, n_data = cfg.train.steps, cfg.data.num_workers
    names = {h: name for name, h in roles.named().items()}
    busy = {h for n in roles.nodes for h in (n.sink, *n.prefetchers, *n.computes)}  # a long call in flight
    health = Health({names[h]: h for h in names if h not in busy}, {names[h]: h for h in busy},
                    cfg.cluster.health_timeout_s, start_s,  # before the loops start: it asks every role where it runs
                    stall_s(roles.pace, timeout), {names[n.queues] for n in roles.nodes if n.queues is not None})
    loops = {h.run.options(name=loop_task(names[h], cls, start, steps)).remote(start, steps): names[h]
             for n in roles.nodes for h, cls in (*((p, "Prefetcher") for p in n.prefetchers), (n.sink, "GradientSink"))}
    batches: dict[int, Any] = {}

    def batch_ref(step: int):
        """The batch of ``step``, with the next few already requested from the loader actors."""
        for s in range(step, min(steps, step + 2 * n_data)):
            if s not in batches:
                batches[s] = roles.loaders[s % n_data].batch.remote(s)
        return batches.pop(step)

    # One fixed validation batch (read before Ray started), in the object store once for the attempt.
    eval_ref = None if val_batch is None else ray.put(val_batch)

    run_id = os.path.basename(run_dir)  # spec.run_id carries a -rN suffix after a restart
    if result is None:
        result = RunResult(run_id=run_id, run_dir=run_dir, final_dir=os.path.join(run_dir, "final"), start_step=start)
    gauges = RunMetrics(run_id, cfg.model, cfg.train.seq_len, spec.nbytes(), active.trackers, cfg.lora)
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as metrics:  # a restart appends (after _rewind)
        return Driver(run, roles, loops, checkpoints, result, metrics, gauges, log, eval_ref, health).run(batch_ref, start)
