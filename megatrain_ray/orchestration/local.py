"""A single-process driver of the same engine, without Ray: the plain actor classes run as threads.

Used by the benchmark to measure what Ray orchestration costs (same store, same prefetcher,
compute worker and sink code; ``queue.Queue`` instead of the queue host's queues; method calls instead of
actor calls). Segments are removed on every exit path, as in :func:`megatrain_ray.orchestration.pipeline.train`.
"""

from __future__ import annotations

import os
import threading
import uuid

from ..config import TrainConfig
from ..data.loader import source_from_config
from ..engine.store import shm
from ..engine.compute.resident import sync_due
from ..errors import ConfigError
from ..model.precision import resolve_device
from .cluster import connect_ray
from .resolve import Facts, resolve
from .roles import LocalSpawner, spawn_roles


def train_local(cfg: TrainConfig, gpus_available: float) -> list[dict]:
    """Run cfg.train.steps steps in this process; returns one row per step (compute output + sink stats)."""
    steps = cfg.train.steps
    if cfg.parallel.workers > 1:
        raise ConfigError("the single-process driver runs one compute worker; set parallel.compute_workers=1 and "
                          "parallel.nodes=1 (several run through the Ray pipeline).")
    run = resolve(cfg, Facts.here(cfg, resolve_device(cfg.compute, gpus_available)))
    spec = run.store_spec(os.getpid(), "local-" + uuid.uuid4().hex[:6])
    source = source_from_config(cfg, connect=connect_ray)
    eval_batch = source_from_config(cfg, "val", connect=connect_ray).batch(0) if cfg.train.eval_every else None
    roles = None
    errors: list[BaseException] = []

    def loop(fn, *args):
        try:
            fn(*args)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    try:
        roles = spawn_roles(run, [spec], LocalSpawner()).head  # the store creates and fills the segments
        compute = roles.computes[0]
        threads = [threading.Thread(target=loop, args=(h.run, 0, steps), daemon=True)
                   for h in (*roles.prefetchers, roles.sink)]
        for t in threads:
            t.start()
        rows = []
        for step in range(steps):
            if errors:
                raise errors[0]
            rows.append(compute.run_step(step, source.batch(step), eval_batch if cfg.train.eval_due(step) else None,
                                         sync=sync_due(None, step, 0, steps)))  # the end: the resident units' copy
        for row in rows:
            stats = roles.stats_q.get(timeout=run.call_timeout_s)
            row["intervals"] = row["intervals"] + stats.pop("intervals")
            row.update(stats)
        for t in threads:
            t.join(timeout=run.call_timeout_s)
        if errors:
            raise errors[0]
        return rows
    finally:
        if roles is not None:
            for handle in (*roles.computes, roles.sink):
                handle.close()
        shm.remove_run(spec.shm_dir, spec.owner_pid, spec.run_id)
