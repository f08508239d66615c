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
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.queue import Queue
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from . import shm
from .compute import ComputeWorker
from .config import TrainConfig
from .data import BatchSource, source_from_config
from .errors import ConfigError, MegatrainError, PipelineError
from .precision import resolve_device, resolve_precision
from .prefetch import Prefetcher
from .sink import GradientSink
from .store import ParameterStore, StoreSpec


@dataclass
class RunResult:
    """What a finished run reports."""

    run_id: str
    run_dir: str
    final_dir: str
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    fetches: list[dict[str, int]] = field(default_factory=list)
    tokens_per_s: float = 0.0
    timeline: list[tuple] = field(default_factory=list)
    """(lane, label, start, end, bytes) spans of the last two steps: h2d, compute, d2h, wait
    (the compute thread blocked on weights) and adamw."""
    last_spans: list[tuple] = field(default_factory=list, repr=False)


def connect_ray(cfg: TrainConfig) -> None:
    """Join the cluster named by runtime.ray_address (or RAY_ADDRESS under ray job), else start one."""
    if ray.is_initialized():
        return
    address = cfg.runtime.ray_address or os.environ.get("RAY_ADDRESS")
    try:
        if address:
            ray.init(address=address, log_to_driver=True)
        else:
            ray.init(object_store_memory=cfg.runtime.object_store_memory, include_dashboard=False,
                     log_to_driver=True)
    except ConnectionError as e:
        raise PipelineError(f"cannot reach the Ray cluster at {address!r} ({e}); start it with "
                            "`ray start --head` or fix runtime.ray_address.") from None


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


def _actor_error(e: BaseException, role: str) -> MegatrainError:
    cause = getattr(e, "cause", None)
    if isinstance(cause, MegatrainError):
        return type(cause)(str(cause))
    if isinstance(e, ray.exceptions.RayActorError):
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        return PipelineError(f"the {role} actor died ({lines[-1] if lines else 'no reason given'}); "
                             "see its log in the Ray dashboard or /tmp/ray/session_latest/logs.")
    return PipelineError(f"the {role} actor failed: {cause or e}")


def _check_shm_space(spec: StoreSpec) -> None:
    need = spec.nbytes()
    free = shutil.disk_usage(spec.shm_dir).free
    if need > free:
        raise ConfigError(f"the host store needs {need / 2**30:.2f} GiB in runtime.shm_dir "
                          f"({spec.shm_dir}) but only {free / 2**30:.2f} GiB is free; use a smaller "
                          "model, runtime.master_dtype=bfloat16, or a larger /dev/shm.")


def train(cfg: TrainConfig, log=print) -> RunResult:
    """Run cfg.train.steps optimizer steps through the actor pipeline; returns losses and paths."""
    source_from_config(cfg)  # fail on bad data before any actor starts
    # Installed before Ray (which sets its own SIGTERM handler), so SIGTERM unwinds like Ctrl-C.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    roles, spec = _Roles(), None
    try:
        connect_ray(cfg)
        signal.signal(signal.SIGTERM, _raise_interrupt)
        device = resolve_device(cfg.runtime, ray.cluster_resources().get("GPU", 0))
        precision = resolve_precision(cfg.runtime, device)
        run_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        spec = StoreSpec(cfg.model, precision, cfg.runtime.shm_dir, os.getpid(), run_id)
        _check_shm_space(spec)
        for path in shm.remove_stale(cfg.runtime.shm_dir):
            log(f"removed a stale shared-memory segment of a dead run: {path}")
        run_dir = os.path.abspath(os.path.join(cfg.runtime.run_dir, run_id))
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=2)
        return _run(cfg, spec, device, run_dir, roles, log)
    finally:
        roles.kill()
        if spec is not None:
            shm.remove_run(spec.shm_dir, spec.owner_pid, spec.run_id)
        signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _spawn(cfg: TrainConfig, spec: StoreSpec, device: str, roles: _Roles) -> None:
    rt, n_data = cfg.runtime, cfg.data.num_workers
    cpu = os.cpu_count() or 2
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
    fetch_q = Queue(maxsize=rt.buffer_depth, **queue_opts)
    release_q = Queue(maxsize=rt.buffer_depth, **queue_opts)
    grad_q = Queue(maxsize=0, **queue_opts)
    stats_q = Queue(maxsize=0, **queue_opts)
    roles.queues = [fetch_q, release_q, grad_q, stats_q]
    roles.stats_q = stats_q

    store = remote(ParameterStore, "store", 0, num_cpus=0.25).remote(spec, cfg.train.seed, rt.init_from, cpu)
    roles.actors["store"] = store
    _get(store.ready.remote(), "store", rt.actor_timeout_s)
    roles.actors["prefetch"] = remote(Prefetcher, "prefetch", 1, num_cpus=0.25).remote(
        spec, rt.buffer_depth, fetch_q, release_q, rt.actor_timeout_s)
    roles.actors["compute"] = remote(ComputeWorker, "compute", 2, num_cpus=0.5,
                                     num_gpus=1 if device == "cuda" else 0).remote(
        spec, device, rt.buffer_depth, rt.loss_chunk_size, fetch_q, grad_q, release_q,
        rt.actor_timeout_s, cpu if device == "cpu" else None)
    roles.actors["grad-sink"] = remote(GradientSink, "grad-sink", 3, num_cpus=0.5).remote(
        spec, cfg.optim, cfg.train.steps, grad_q, stats_q, rt.actor_timeout_s, cpu)
    for k in range(n_data):
        roles.actors[f"data-{k}"] = remote(BatchSource, f"data-{k}", 4 + k, num_cpus=0.25).remote(
            cfg.data.path and os.path.abspath(cfg.data.path), cfg.train.seq_len,
            cfg.train.micro_batch_size, cfg.train.num_micro_batches, cfg.train.seed, cfg.model.vocab_size)


def _get(ref, role: str, timeout: float):
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise PipelineError(f"the {role} actor did not answer within {timeout:.0f} s "
                            "(runtime.actor_timeout_s).") from None
    except (ray.exceptions.RayError, MegatrainError) as e:
        raise _actor_error(e, role) from None


def _run(cfg: TrainConfig, spec: StoreSpec, device: str, run_dir: str, roles: _Roles, log) -> RunResult:
    _spawn(cfg, spec, device, roles)
    a = roles.actors
    steps, n_data = cfg.train.steps, cfg.data.num_workers
    loops = {a["prefetch"].run.remote(0, steps): "prefetch", a["grad-sink"].run.remote(0, steps): "grad-sink"}
    batches: dict[int, Any] = {}

    def batch_ref(step: int):
        """The batch of ``step``, with the next few already requested from the loader actors."""
        for s in range(step, min(steps, step + 2 * n_data)):
            if s not in batches:
                batches[s] = a[f"data-{s % n_data}"].batch.remote(s)
        return batches.pop(step)

    result = RunResult(run_id=spec.run_id, run_dir=run_dir, final_dir=os.path.join(run_dir, "final"))
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as metrics:
        return _steps(cfg, a, loops, batch_ref, result, metrics, roles, log)


def _steps(cfg: TrainConfig, a: dict, loops: dict, batch_ref, result: RunResult, metrics, roles: _Roles,
           log) -> RunResult:
    """The driver's loop: keep two steps queued at the compute actor, log each as its stats arrive."""
    steps = cfg.train.steps
    window = 2  # run_step calls queued at the compute actor, so it never waits on the driver
    submitted = {s: a["compute"].run_step.remote(s, batch_ref(s)) for s in range(min(window, steps))}
    start, tokens, pending_stats = time.perf_counter(), 0, {}
    for step in range(steps):
        ref = submitted.pop(step)
        while True:
            done, _ = ray.wait([ref, *loops], num_returns=1, timeout=1.0)
            if ref in done:
                break
            for r in done:  # a loop ended early: fine if it finished its work, else its error is raised
                _get(r, loops.pop(r), cfg.runtime.actor_timeout_s)
        out = _get(ref, "compute", cfg.runtime.actor_timeout_s)
        nxt = step + window
        if nxt < steps:
            submitted[nxt] = a["compute"].run_step.remote(nxt, batch_ref(nxt))
        tokens += out["tokens"]
        result.losses.append(out["loss"])
        result.fetches.append(out["fetches"])
        pending_stats[step] = out
        for st in _drain(roles.stats_q):
            _log_step(pending_stats.pop(st["step"]), st, steps, tokens, start, result, metrics, log, cfg)
    for r, role in loops.items():
        _get(r, role, cfg.runtime.actor_timeout_s)
    for st in _drain(roles.stats_q):
        _log_step(pending_stats.pop(st["step"]), st, steps, tokens, start, result, metrics, log, cfg)
    result.tokens_per_s = tokens / (time.perf_counter() - start)
    _get(a["store"].save_hf.remote(result.final_dir), "store", cfg.runtime.actor_timeout_s)
    log(f"done: {steps} steps, final loss {result.losses[-1]:.4f}, {result.tokens_per_s:,.0f} tokens/s; "
        f"weights saved to {result.final_dir}")
    return result


def _drain(q: Queue) -> list[dict]:
    items = []
    while not q.empty():
        items.append(q.get())
    return items


def _log_step(out, stats, steps, tokens, start, result, metrics, log, cfg) -> None:
    step = out["step"]
    result.grad_norms.append(stats["grad_norm"])
    spans = out["spans"] + stats["spans"]
    result.timeline, result.last_spans = result.last_spans + spans, spans
    elapsed = time.perf_counter() - start
    row = {"step": step, "loss": out["loss"], "grad_norm": stats["grad_norm"], "lr": stats["lr"],
           "tokens": out["tokens"], "start": out["start"], "step_s": out["step_s"], "fetches": out["fetches"],
           "elapsed_s": elapsed, "update_busy_s": stats["update_busy_s"],
           **{k: v for k, v in out.items() if k.endswith(("_busy_s", "_bytes"))}}
    metrics.write(json.dumps(row) + "\n")
    metrics.flush()
    if step % cfg.train.log_every == 0 or step == steps - 1:
        log(f"step {step + 1:>5}/{steps} | loss {out['loss']:.4f} | grad norm {stats['grad_norm']:.3f} | "
            f"lr {stats['lr']:.2e} | {tokens / elapsed:,.0f} tok/s")
