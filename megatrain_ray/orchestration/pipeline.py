"""The driver: starts the actor pipeline on one node, runs the steps, and always cleans up.

::

    DataLoader-k --batch refs--> driver --run_step(t, batch)--> ComputeWorker
    ParameterStore (owns /dev/shm segments)         ^ fetch_q (FetchTicket, cap = buffer_depth)
    Prefetcher ---------------- fetch_q ------------+       | release_q (slot ids)
        ^ polls unit versions in shared memory              | grad_q (GradTicket)
    GradientSink <------------- grad_q ---------------------+
        '-- stats_q (grad norm, lr) --> driver

Every actor is a plain class made remote here, placed in one STRICT_PACK placement group. The
driver holds the long-running loop calls of the prefetcher and the sink and waits on them together
with each step, so the first actor failure ends the run with an error naming the role. Whatever
happens (success, exception, Ctrl-C, SIGTERM), the placement group, the actors and the store's
shared-memory segments are removed before :func:`train` returns or raises.

The Ray it runs on (a running cluster, or a private one) is chosen by :mod:`megatrain_ray.orchestration.cluster`.
Before anything is allocated, :mod:`megatrain_ray.orchestration.preflight` checks that the run fits host RAM
and runtime.shm_dir. Checkpoints (:mod:`megatrain_ray.io.checkpoint`) are saved by the sink every
train.checkpoint_every steps and at the end; on Ctrl-C / SIGTERM (``ray job stop``) the driver stops
submitting steps, lets those in flight finish (a second signal skips this), and has the store
actor save the boundary they reach. ``train(cfg, resume=checkpoint_dir)`` loads one and runs the
steps [its step, train.steps) with the same schedule, so the result is bit-identical to an
uninterrupted run. Every step is a row of runs/<id>/metrics.jsonl and a set of Ray gauges
(:mod:`megatrain_ray.orchestration.metrics`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.queue import Queue
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..config import TrainConfig, usable_cpus
from ..data.datasets import run_tokenizer
from ..data.loader import loader_spec, source_from_config
from ..engine import shm
from ..engine.compute import ComputeWorker
from ..engine.prefetch import Prefetcher
from ..engine.sink import GradientSink
from ..engine.store import ParameterStore, StoreSpec, grad_slots_for
from ..errors import MegatrainError, PipelineError
from ..io import checkpoint
from ..model.precision import resolve_device, resolve_precision
from . import cluster, preflight
from .cluster import connect_ray
from .metrics import RunMetrics


@dataclass
class RunResult:
    """What a finished run reports."""

    run_id: str
    run_dir: str
    final_dir: str
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    val_losses: dict[int, float] = field(default_factory=dict)
    """step -> validation loss of the weights that step started from (train.eval_every)."""
    fetches: list[dict[str, int]] = field(default_factory=list)
    tokens_per_s: float = 0.0
    timeline: list[tuple] = field(default_factory=list)
    """(lane, label, start, end, bytes) spans of the last two steps: h2d, compute, d2h, wait
    (the compute thread blocked on weights) and adamw."""
    last_spans: list[tuple] = field(default_factory=list, repr=False)
    start_step: int = 0
    """First step this run trained (the checkpoint's step when resumed)."""
    checkpoints: list[str] = field(default_factory=list)
    """Checkpoint directories saved by this run, oldest first."""


class ActorDied(PipelineError):
    """An actor of the pipeline died (killed, OOM, node failure): the run can restart from a checkpoint."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM ended the run; ``checkpoint`` is where its state was saved, if anywhere."""

    def __init__(self, checkpoint: str | None = None, note: str = ""):
        super().__init__(checkpoint or note)
        self.checkpoint = checkpoint
        self.note = note


class _Roles:
    """The spawned actors and queues of one run, and how to tear them down."""

    def __init__(self) -> None:
        self.actors: dict[str, Any] = {}
        self.queues: list[Queue] = []
        self.stats_q: Queue | None = None
        self.pg = None

    def kill(self) -> None:
        for handle in list(self.actors.values()):
            try:
                ray.kill(handle, no_restart=True)
            except Exception:
                pass
        for q in self.queues:
            try:
                q.shutdown(force=True)
            except Exception:
                pass
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
        self.__init__()  # empty again: a restarted pipeline spawns into the same object


def _actor_error(e: BaseException, role: str) -> MegatrainError:
    cause = getattr(e, "cause", None)
    if isinstance(cause, MegatrainError):
        return type(cause)(str(cause))
    if isinstance(e, ray.exceptions.OutOfMemoryError) or isinstance(cause, ray.exceptions.OutOfMemoryError):
        return PipelineError(
            f"the machine ran out of host memory: Ray's memory monitor killed the {role} actor's work "
            f"(it does past {preflight.RAY_MEMORY_THRESHOLD:.0%} of RAM by default); see what the run needs with "
            "`megatrain-ray plan` and stop other memory users, or lower it (runtime.master_dtype=bfloat16, "
            "runtime.offload_activations=false, a smaller model or micro-batch).")
    if isinstance(e, ray.exceptions.RayActorError):
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        return ActorDied(f"the {role} actor died ({lines[-1] if lines else 'no reason given'}); "
                             "see its log in the Ray dashboard or /tmp/ray/session_latest/logs.")
    return PipelineError(f"the {role} actor failed: {cause or e}")


def train(cfg: TrainConfig, log=print, resume: str | None = None) -> RunResult:
    """Run optimizer steps [start, cfg.train.steps) through the actor pipeline; returns losses and paths.

    ``resume``: a checkpoint directory (see :func:`megatrain_ray.io.checkpoint.resume_config`); the
    run continues from its step, bit for bit, unless cfg changes the lr schedule (a larger
    train.steps extends a run: see :func:`megatrain_ray.io.checkpoint.check_resume`, whose sentence is
    logged). Ctrl-C and SIGTERM save a checkpoint, then raise :class:`Interrupted`.
    """
    start_step, schedule_note = 0, None
    if resume is not None:  # nothing to resume is refused before the data is read
        meta = checkpoint.read_meta(resume)
        schedule_note = checkpoint.check_resume(meta, cfg, resume)
    source = source_from_config(cfg, connect=connect_ray)  # fail on bad data or weights before any actor starts
    if resume is None:
        preflight.check_init_from(cfg)
    else:
        checkpoint.check_model(meta, cfg.model, resume)
        checkpoint.check_files(resume)
        start_step = meta["step"]
        if hasattr(source, "resume_step") and "fingerprint" in meta.get("data", {}):
            source.resume_step(meta["data"])  # the same data, seed and batch shape
    preflight.check(cfg, preflight.guess_device(cfg), log, starts_ray=cluster.starts_ray(cfg.runtime))
    # Installed before Ray (which sets its own SIGTERM handler), so SIGTERM unwinds like Ctrl-C.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    roles, spec, plan = _Roles(), None, None
    try:
        cluster.connect(cfg.runtime, log)
        signal.signal(signal.SIGTERM, _raise_interrupt)
        device = resolve_device(cfg.runtime, ray.cluster_resources().get("GPU", 0))
        precision = resolve_precision(cfg.runtime, device)
        preflight.check(cfg, device, log, starts_ray=False)
        run_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        spec = StoreSpec(cfg.model, precision, cfg.runtime.shm_dir, os.getpid(), run_id,
                         grad_slots_for(precision, cfg.optim.max_grad_norm))
        for path in shm.remove_stale(cfg.runtime.shm_dir):
            log(f"removed a stale shared-memory segment of a dead run: {path}")
        run_dir = os.path.abspath(os.path.join(cfg.runtime.run_dir, run_id))
        os.makedirs(run_dir, exist_ok=True)
        log(f"run {run_id}: config, metrics, checkpoints and weights go to {run_dir}")
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump({**cfg.to_dict(), "device": device, **({"resumed_from": resume} if resume else {})}, f,
                      indent=2)
        plan = checkpoint.CheckpointPlan(os.path.join(run_dir, "checkpoints"), cfg.train.checkpoint_every,
                                         cfg.train.keep_checkpoints, cfg.to_dict(), run_id,
                                         _data_state(source), wait_s=cfg.runtime.actor_timeout_s)
        if resume is not None:
            log(f"resuming from {resume} at step {start_step}")
            if schedule_note:
                log(schedule_note)
        return _attempts(cfg, spec, device, run_dir, roles, log, start_step, resume, plan)
    except MegatrainError as e:
        last = (plan and checkpoint.latest(plan.directory, missing_ok=True)) or resume
        if last is None or plan is None or last in str(e):
            raise
        raise type(e)(f"{str(e).rstrip('.')}; the last good checkpoint is {last} "
                      f"({checkpoint.advice(last)}).") from None
    finally:
        roles.kill()
        if spec is not None:
            shm.remove_run(spec.shm_dir, spec.owner_pid, spec.run_id)
        signal.signal(signal.SIGTERM, previous)


def _attempts(cfg: TrainConfig, spec: StoreSpec, device: str, run_dir: str, roles: _Roles, log, start: int,
              resume: str | None, plan: checkpoint.CheckpointPlan) -> RunResult:
    """Run the pipeline; when an actor dies, restart it (up to runtime.max_restarts times) from the
    newest checkpoint of the run, or from where the run began if there is none yet.

    The store is never trusted after a death (a unit may be half-updated); a checkpoint is a step
    boundary and resuming from one is bit-exact, so the run ends with the weights of an unfaulted one.
    """
    base_id = spec.run_id
    for attempt in range(cfg.runtime.max_restarts + 1):
        try:
            return _run(cfg, spec, device, run_dir, roles, log, start, resume, plan)
        except ActorDied as e:
            if attempt == cfg.runtime.max_restarts:
                raise
            roles.kill()
            shm.remove_run(spec.shm_dir, spec.owner_pid, spec.run_id)
            resume = checkpoint.latest(plan.directory, missing_ok=True) or resume
            start = checkpoint.read_meta(resume)["step"] if resume else 0
            spec = dataclasses.replace(spec, run_id=f"{base_id}-r{attempt + 1}")
            log(f"restart {attempt + 1} of {cfg.runtime.max_restarts}: {str(e).rstrip('.')}; restarting the pipeline "
                f"from {resume or 'the initial weights'} (step {start}).")
    raise AssertionError("unreachable")


def _data_state(source) -> dict:
    """The loader's position record without its step (each checkpoint adds its own next_step)."""
    state = source.state(0) if hasattr(source, "state") else {}
    return {k: v for k, v in state.items() if k != "next_step"}


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _spawn(cfg: TrainConfig, spec: StoreSpec, device: str, roles: _Roles, resume: str | None = None,
           plan: checkpoint.CheckpointPlan | None = None) -> None:
    rt, n_data = cfg.runtime, cfg.data.num_workers
    cpu = usable_cpus()
    bundles = [{"CPU": 0.25}, {"CPU": 0.25}, {"CPU": 0.5, **({"GPU": 1} if device == "cuda" else {})},
               {"CPU": 0.5}] + [{"CPU": 0.25}] * n_data
    roles.pg = placement_group(bundles, strategy="STRICT_PACK", name=f"megatrain-{spec.run_id}")
    ready, _ = ray.wait([roles.pg.ready()], timeout=60)
    if not ready:
        raise PipelineError(f"the Ray cluster cannot place the pipeline's actors on one node (needs "
                            f"{sum(b.get('CPU', 0) for b in bundles)} CPUs"
                            f"{' and 1 GPU' if device == 'cuda' else ''}); free resources or start "
                            "Ray with more.")

    def remote(cls, role: str, bundle: int, **resources):
        return ray.remote(cls).options(
            name=f"{role}-{spec.run_id}", max_concurrency=1, max_restarts=0, **resources,
            scheduling_strategy=PlacementGroupSchedulingStrategy(roles.pg, placement_group_bundle_index=bundle))

    queue_opts = {"actor_options": {"num_cpus": 0, "scheduling_strategy": PlacementGroupSchedulingStrategy(
        roles.pg, placement_group_bundle_index=0)}}
    depth = rt.buffer_depth_on(device)
    fetch_q = Queue(maxsize=depth, **queue_opts)
    release_q = Queue(maxsize=depth, **queue_opts)
    grad_q = Queue(maxsize=0, **queue_opts)
    stats_q = Queue(maxsize=0, **queue_opts)
    grad_slot_q = Queue(maxsize=0, **queue_opts) if spec.grad_slots else None
    roles.queues = [q for q in (fetch_q, release_q, grad_q, stats_q, grad_slot_q) if q is not None]
    roles.stats_q = stats_q

    store = remote(ParameterStore, "store", 0, num_cpus=0.25).remote(spec, cfg.train.seed, rt.init_from, cpu,
                                                                     resume_from=resume)
    roles.actors["store"] = store
    _get(store.ready.remote(), "store", rt.actor_timeout_s)
    roles.actors["prefetch"] = remote(Prefetcher, "prefetch", 1, num_cpus=0.25).remote(
        spec, depth, fetch_q, release_q, rt.actor_timeout_s)
    roles.actors["compute"] = remote(ComputeWorker, "compute", 2, num_cpus=0.5,
                                     num_gpus=1 if device == "cuda" else 0).remote(
        spec, device, depth, rt.loss_chunk_size_on(device), fetch_q, grad_q, release_q,
        rt.actor_timeout_s, cpu if device == "cpu" else None, compile_layers=rt.compile_on(device),
        offload_activations=rt.offload_activations, grad_slot_q=grad_slot_q, compile_threads=rt.compile_threads)
    roles.actors["grad-sink"] = remote(GradientSink, "grad-sink", 3, num_cpus=0.5).remote(
        spec, cfg.optim, cfg.train.steps, grad_q, stats_q, rt.actor_timeout_s, rt.adamw_threads(),
        checkpoint=plan, grad_slot_q=grad_slot_q)
    loader_cls, loader_args = loader_spec(cfg, connect=connect_ray)  # BatchSource, or CorpusSource over the prepared corpus
    for k in range(n_data):
        roles.actors[f"data-{k}"] = remote(loader_cls, f"data-{k}", 4 + k, num_cpus=0.25).remote(*loader_args)


def _get(ref, role: str, timeout: float):
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise PipelineError(f"the {role} actor did not answer within {timeout:.0f} s "
                            "(runtime.actor_timeout_s).") from None
    except (ray.exceptions.RayError, MegatrainError) as e:
        raise _actor_error(e, role) from None


def _run(cfg: TrainConfig, spec: StoreSpec, device: str, run_dir: str, roles: _Roles, log, start: int = 0,
         resume: str | None = None, plan: checkpoint.CheckpointPlan | None = None) -> RunResult:
    _spawn(cfg, spec, device, roles, resume, plan)
    a = roles.actors
    steps, n_data = cfg.train.steps, cfg.data.num_workers
    loops = {a["prefetch"].run.remote(start, steps): "prefetch",
             a["grad-sink"].run.remote(start, steps): "grad-sink"}
    batches: dict[int, Any] = {}

    def batch_ref(step: int):
        """The batch of ``step``, with the next few already requested from the loader actors."""
        for s in range(step, min(steps, step + 2 * n_data)):
            if s not in batches:
                batches[s] = a[f"data-{s % n_data}"].batch.remote(s)
        return batches.pop(step)

    eval_ref = None
    if cfg.train.eval_every:  # one fixed validation batch, in the object store once for the whole run
        eval_ref = ray.put(source_from_config(cfg, "val", log, connect_ray).batch(0))

    run_id = os.path.basename(run_dir)  # spec.run_id carries a -rN suffix after a restart
    result = RunResult(run_id=run_id, run_dir=run_dir, final_dir=os.path.join(run_dir, "final"), start_step=start)
    gauges = RunMetrics(run_id, cfg.model, cfg.train.seq_len, spec.nbytes())
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as metrics:  # a restart appends
        return _Driver(cfg, a, loops, roles, plan, result, metrics, gauges, log, eval_ref).run(batch_ref, start)


@contextlib.contextmanager
def _signals_deferred():
    """Hold SIGINT/SIGTERM until the block ends, so a submitted step is always recorded as such."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _Driver:
    """The driver's loop over one run's steps: submit, wait, log; on an interrupt, drain and save.

    Two ``run_step`` calls are kept queued at the compute actor, so it never waits on the driver.
    Each step's compute result (loss, timings) and the sink's stats (grad norm, lr) are joined into
    one metrics row when both are in.
    """

    WINDOW = 2

    def __init__(self, cfg: TrainConfig, actors: dict, loops: dict, roles: _Roles,
                 plan: checkpoint.CheckpointPlan | None, result: RunResult, metrics_file, gauges: RunMetrics, log,
                 eval_ref=None):
        self.cfg, self.a, self.loops, self.roles, self.plan = cfg, actors, loops, roles, plan
        self.eval_ref = eval_ref
        """The validation batch (an object ref) that rides along every train.eval_every-th step, or None."""
        self.result, self.metrics_file, self.gauges, self.log = result, metrics_file, gauges, log
        self.steps = cfg.train.steps
        self.timeout = cfg.runtime.actor_timeout_s
        self.submitted: dict[int, Any] = {}
        """step -> ref of its run_step call, until its result is in."""
        self.outputs: dict[int, dict] = {}
        self.stats: dict[int, dict] = {}
        self.tokens = 0
        self.clock = time.perf_counter()
        self.steady: tuple[float, int] | None = None
        """(time, steps done) at the end of the first step this driver logged: the ETA is timed from
        there, leaving out the first step's compile and warm-up."""

    def run(self, batch_ref, start: int) -> RunResult:
        try:
            for step in range(start, min(start + self.WINDOW, self.steps)):
                self._submit(step, batch_ref)
            for step in range(start, self.steps):
                self._collect(step)
                if step + self.WINDOW < self.steps:
                    self._submit(step + self.WINDOW, batch_ref)
                self._handle(_drain(self.roles.stats_q))
            for ref, role in list(self.loops.items()):  # the sink's ends with the final checkpoint
                _get(ref, role, self.timeout)
            self._handle(_drain(self.roles.stats_q))
        except KeyboardInterrupt:
            raise Interrupted(*self._checkpoint_on_interrupt(start)) from None
        r = self.result
        r.tokens_per_s = self.tokens / (time.perf_counter() - self.clock)
        if self.cfg.train.save_final:  # with the tokenizer the data was read with, for generate()
            tokenizer = run_tokenizer(dataclasses.asdict(self.cfg.data), self.cfg.runtime.init_from)
            if self.plan is not None and not self.plan.every:  # the weights on disk before the export
                try:
                    r.checkpoints.append(_get(self.a["store"].save_checkpoint.remote(self.plan, self.steps), "store",
                                              self.timeout))
                    self.log(f"checkpoint: step {self.steps} saved to {r.checkpoints[-1]}")
                except MegatrainError as e:  # it needs 3x the export's space: the export may still fit
                    self.log(f"warning: {str(e).rstrip('.')}; exporting the final weights without it")
            _get(self.a["store"].save_hf.remote(r.final_dir, tokenizer=tokenizer), "store", self.timeout)
        with open(os.path.join(r.run_dir, "timeline.json"), "w") as f:
            json.dump(r.timeline, f)
        loss = f"final loss {r.losses[-1]:.4f}, " if r.losses else ""
        saved = f"weights saved to {r.final_dir}" if self.cfg.train.save_final else "final weights not saved"
        self.log(f"done: {self.steps - start} steps, {loss}{r.tokens_per_s:,.0f} tokens/s; {saved}")
        return r

    def _submit(self, step: int, batch_ref) -> None:
        with _signals_deferred():
            due = self.cfg.train.eval_due(step)
            self.submitted[step] = self.a["compute"].run_step.remote(step, batch_ref(step),
                                                                     self.eval_ref if due else None)

    def _collect(self, step: int) -> None:
        """Wait for run_step(step), watching the prefetcher and sink loops for failures."""
        ref = self.submitted[step]
        while True:
            done, _ = ray.wait([ref, *self.loops], num_returns=1, timeout=1.0)
            if ref in done:
                break
            for r in done:  # a loop ended early: fine if it finished its work, else its error is raised
                _get(r, self.loops.pop(r), self.timeout)
        out = _get(ref, "compute", self.timeout)
        del self.submitted[step]
        if not math.isfinite(out["loss"]):
            self._diverged(step, out["loss"])
        self.tokens += out["tokens"]
        self.result.losses.append(out["loss"])
        self.result.fetches.append(out["fetches"])
        self.outputs[step] = out

    def _diverged(self, step: int, loss: float) -> None:
        """Let the sink reach its verdict on this step (and finish any save it is writing), then stop."""
        sink = [r for r, role in self.loops.items() if role == "grad-sink"]
        deadline = time.monotonic() + self.timeout
        while sink and step not in self.stats and time.monotonic() < deadline:
            done, _ = ray.wait(sink, timeout=0.5)
            if done:
                try:
                    _get(done[0], "grad-sink", self.timeout)
                except MegatrainError:
                    pass  # its non-finite gradient norm: the same divergence, said below
                break
            self._handle(_drain(self.roles.stats_q))
        raise PipelineError(f"the loss of step {step + 1} is {loss}, so training diverged; lower optim.lr "
                            "(or raise optim.warmup_steps) or check the data.")

    def _handle(self, items: list[dict]) -> None:
        """Record sink messages: checkpoint notices, and step stats (logged once the step's output is in)."""
        for st in items:
            if "checkpoint" in st:
                self.result.checkpoints.append(st["checkpoint"])
                self.gauges.checkpoint(st["step"])
                self.log(f"checkpoint: step {st['step']} saved to {st['checkpoint']} in {st['save_s']:.2f} s")
            else:
                self.stats[st["step"]] = st
        for step in sorted(s for s in self.stats if s in self.outputs):
            self._log_step(self.outputs.pop(step), self.stats.pop(step))

    def _log_step(self, out: dict, stats: dict) -> None:
        step, r = out["step"], self.result
        r.grad_norms.append(stats["grad_norm"])
        if "val_loss" in out:
            r.val_losses[step] = out["val_loss"]
        spans = out["spans"] + stats["spans"]
        r.timeline, r.last_spans = r.last_spans + spans, spans
        now = time.perf_counter()
        elapsed, done = now - self.clock, step + 1 - r.start_step
        if self.steady is None:
            self.steady = (now, done)
        since, steady_done = self.steady
        left = self.steps - step - 1
        if not left:
            eta = 0.0
        elif done > steady_done:
            eta = (now - since) / (done - steady_done) * left  # at the pace of the steps since the first
        else:
            eta = None  # the first step's compile and warm-up say nothing of the pace to come
        row = {"step": step, "loss": out["loss"], "grad_norm": stats["grad_norm"], "lr": stats["lr"],
               "tokens": out["tokens"], "start": out["start"], "step_s": out["step_s"], "fetches": out["fetches"],
               "elapsed_s": elapsed, "eta_s": eta, "update_busy_s": stats["update_busy_s"],
               "tokens_per_s": out["tokens"] / max(out["step_s"], 1e-9),
               "model_tflops": out["tokens"] * self.gauges.flops_per_token / max(out["step_s"], 1e-9) / 1e12,
               **{k: v for k, v in out.items() if k.endswith(("_busy_s", "_bytes"))},
               **({"val_loss": out["val_loss"]} if "val_loss" in out else {})}
        self.metrics_file.write(json.dumps(row) + "\n")
        self.metrics_file.flush()
        self.gauges.step(row, _size(self.roles.queues[2]) if len(self.roles.queues) > 2 else None)
        if step % self.cfg.train.log_every == 0 or step == self.steps - 1 or "val_loss" in out:
            val = f" | val loss {out['val_loss']:.4f} (after {step} updates)" if "val_loss" in out else ""
            self.log(f"step {step + 1:>5}/{self.steps} | loss {out['loss']:.4f} | grad norm {stats['grad_norm']:.3f} | "
                     f"lr {stats['lr']:.2e} | {self.tokens / elapsed:,.0f} tok/s | eta {_duration(eta)}{val}")

    def _checkpoint_on_interrupt(self, start: int) -> tuple[str | None, str]:
        """Finish the steps in flight, then save the boundary they reach; (path or None, why not)."""
        if self.plan is None:
            return None, "checkpoints are off"
        done = start + len(self.result.losses)
        boundary = max(self.submitted, default=done - 1) + 1
        if boundary <= start:
            return None, "no step had finished"
        self.log(f"interrupted: finishing the steps up to {boundary} and saving a checkpoint "
                 "(interrupt again to stop without one)")
        try:
            for step in sorted(self.submitted):
                out = _get(self.submitted.pop(step), "compute", self.timeout)
                if not math.isfinite(out["loss"]):
                    return None, f"the loss of step {step + 1} is {out['loss']}"
                self.tokens += out["tokens"]
                self.result.losses.append(out["loss"])
                self.outputs[step] = out
            # The store actor waits until the sink has applied every submitted step's update.
            save = self.a["store"].save_checkpoint.remote(self.plan, boundary)
            while True:
                ready, _ = ray.wait([save, *self.loops], num_returns=1, timeout=1.0)
                if save in ready:
                    break
                for r in ready:
                    _get(r, self.loops.pop(r), self.timeout)
                self._handle(_drain(self.roles.stats_q))
            path = _get(save, "store", self.timeout)
            self._handle(_drain(self.roles.stats_q))
        except MegatrainError as e:
            return None, f"no checkpoint could be saved ({e})"
        self.result.checkpoints.append(path)
        self.log(f"checkpoint: step {boundary} saved to {path}")
        return path, ""


def _drain(q: Queue) -> list[dict]:
    items = []
    while not q.empty():
        items.append(q.get())
    return items


def _size(q: Queue) -> int | None:
    try:
        return q.size()
    except Exception:
        return None


def _duration(seconds: float | None) -> str:
    """1h02m, 3m05s, 42s; ``...`` while unknown (None)."""
    if seconds is None:
        return "..."
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"
