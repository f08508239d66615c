"""A single-process driver of the same engine, without Ray: the plain actor classes run as threads.

Used by the benchmark to measure what Ray orchestration costs (same store, same prefetcher,
compute worker and sink code; ``queue.Queue`` instead of Ray queues; method calls instead of
actor calls). Segments are removed on every exit path, as in :func:`megatrain_ray.orchestration.pipeline.train`.
"""

from __future__ import annotations

import os
import queue
import threading
import uuid

from ..config import TrainConfig
from ..data.loader import source_from_config
from ..engine import shm
from ..engine.compute import ComputeWorker
from ..engine.prefetch import Prefetcher
from ..engine.sink import GradientSink
from ..engine.store import ParameterStore, StoreSpec, grad_slots_for
from ..model.precision import resolve_device, resolve_precision
from .cluster import connect_ray


def train_local(cfg: TrainConfig, gpus_available: float) -> list[dict]:
    """Run cfg.train.steps steps in this process; returns one row per step (compute output + sink stats)."""
    rt, steps = cfg.runtime, cfg.train.steps
    device = resolve_device(rt, gpus_available)
    precision = resolve_precision(rt, device)
    spec = StoreSpec(cfg.model, precision, rt.shm_dir, os.getpid(), "local-" + uuid.uuid4().hex[:6],
                     grad_slots_for(precision, cfg.optim.max_grad_norm))
    source = source_from_config(cfg, connect=connect_ray)
    eval_batch = source_from_config(cfg, "val", connect=connect_ray).batch(0) if cfg.train.eval_every else None
    depth = rt.buffer_depth_on(device)
    fetch_q, release_q = queue.Queue(depth), queue.Queue(depth)
    grad_q, stats_q, grad_slot_q = queue.Queue(), queue.Queue(), queue.Queue()
    compute = sink = None
    errors: list[BaseException] = []

    def loop(fn, *args):
        try:
            fn(*args)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    try:
        ParameterStore(spec, cfg.train.seed, rt.init_from)  # creates and fills the segments
        prefetcher = Prefetcher(spec, depth, fetch_q, release_q, rt.actor_timeout_s)
        compute = ComputeWorker(spec, device, depth, rt.loss_chunk_size_on(device), fetch_q, grad_q, release_q,
                                rt.actor_timeout_s, compile_layers=rt.compile_on(device),
                                offload_activations=rt.offload_activations, grad_slot_q=grad_slot_q,
                                compile_threads=rt.compile_threads)
        sink = GradientSink(spec, cfg.optim, steps, grad_q, stats_q, rt.actor_timeout_s,
                            rt.adamw_threads(), grad_slot_q=grad_slot_q)
        threads = [threading.Thread(target=loop, args=(prefetcher.run, 0, steps), daemon=True),
                   threading.Thread(target=loop, args=(sink.run, 0, steps), daemon=True)]
        for t in threads:
            t.start()
        rows = []
        for step in range(steps):
            if errors:
                raise errors[0]
            rows.append(compute.run_step(step, source.batch(step), eval_batch if cfg.train.eval_due(step) else None))
        for row in rows:
            stats = stats_q.get(timeout=rt.actor_timeout_s)
            row["spans"] = row["spans"] + stats.pop("spans")
            row.update(stats)
        for t in threads:
            t.join(timeout=rt.actor_timeout_s)
        if errors:
            raise errors[0]
        return rows
    finally:
        if compute is not None:
            compute.close()
        if sink is not None:
            sink.close()
        shm.remove_run(spec.shm_dir, spec.owner_pid, spec.run_id)
