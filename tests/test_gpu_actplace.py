"""GPU checks of the activation placements and the attention backends (skipped without CUDA).

One bf16 step of test_gpu's small Llama shape through the real store, prefetcher and compute worker
with some layers kept whole and some offloaded, against every layer recomputed; the peak device
memory of kept graphs against the planner's estimate; every SDPA backend the GPU offers against
torch's own choice.
"""

import dataclasses
import gc
import os
import queue
import threading
import uuid

import pytest
import torch
from test_actplace import finish_prefetch, step_grads
from test_gpu import _config  # noqa: F401  (the shape and data of tests/test_gpu.py)

from megatrain_ray.data.loader import source_from_config
from megatrain_ray.engine.compute.activations import GPU, KEEP, kept_bytes_per_token, layer_modes
from megatrain_ray.engine.compute.compute_worker import ComputeWorker
from megatrain_ray.engine.prefetch.prefetcher import Prefetcher
from megatrain_ray.engine.schedule import Schedule
from megatrain_ray.engine.store.host_store import ParameterStore, StoreSpec
from megatrain_ray.model.layout import StoreLayout
from megatrain_ray.model.precision import resolve_precision
from megatrain_ray.orchestration.resolve import Facts, resolve

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _step(cfg, placement, compile_layers=False, attention_backend="auto"):
    """One step; returns (result, {unit: {name: fp32 grad}})."""
    spec = StoreSpec(cfg.model, resolve_precision(cfg.precision, "cuda"), cfg.memory.shm_dir, os.getpid(), "gap-" + uuid.uuid4().hex[:6])
    ParameterStore(spec, cfg.train.seed)
    depth = cfg.memory.buffer_depth_on("cuda")
    fetch_q, release_q, grad_q = queue.Queue(depth), queue.Queue(depth), queue.Queue()
    prefetcher = Prefetcher(spec, Schedule.build(StoreLayout.build(cfg.model), cfg.model.tie_word_embeddings), depth,
                            fetch_q, release_q, cfg.cluster.actor_timeout_s)
    thread = threading.Thread(target=prefetcher.run, args=(0, 1), daemon=True)
    thread.start()
    gc.collect()
    torch.cuda.reset_peak_memory_stats()
    worker = None
    try:  # the prefetcher's thread ends whatever happens (a backend this GPU lacks fails the step part-way)
        settings = dataclasses.replace(resolve(cfg, Facts("cuda")).compute, compile=compile_layers,
                                       activations=placement, attention_backend=attention_backend, mlp_chunk_size=0)
        worker = ComputeWorker(spec, settings, fetch_q, grad_q, release_q)
        result = worker.run_step(0, source_from_config(cfg).batch(0))
    finally:
        if worker is not None:
            worker.close()
        finish_prefetch(prefetcher, thread, fetch_q, release_q)
    return result, step_grads(spec, grad_q)


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("compile_layers", [False, True])
def test_kept_and_offloaded_layers_train_as_recomputed_ones(compile_layers, tmp_path, shm_dir):
    """Same function on the same values; the bf16 gradients (rounded once per step) differ at most
    by what the attention backward's atomics and, compiled, the forward graph compiled with
    gradients (the kept layers' outputs) instead of without, leave: a few bf16 ulps, far below the
    1e-2 relative bound, while a wrong weight in a kept graph (e.g. a reused slot) is O(1)."""
    cfg = _config(tmp_path, shm_dir, False)
    ref, ref_grads = _step(cfg, (GPU,) * 4, compile_layers)
    got, grads = _step(cfg, layer_modes(4, 2, 1), compile_layers)
    assert got["fetches"] == ref["fetches"]
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-3
    for unit, named in grads.items():
        for name, g in named.items():
            err = _rel(g, ref_grads[unit][name])
            assert err < 1e-2, f"unit {unit} {name}: relative gradient difference {err:.3g}"


def test_kept_graphs_take_no_more_device_memory_than_planned(tmp_path, shm_dir):
    """Keeping every layer's graph raises the peak by less than the planner's estimate (eager: the
    estimate is what eager autograd saves) and by more than half of it."""
    cfg = _config(tmp_path, shm_dir, False)
    peaks = {mode: _step(cfg, (mode,) * 4)[0]["device_peak_bytes"] for mode in (GPU, KEEP)}
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len * cfg.train.num_micro_batches
    layer_numel = StoreLayout.build(cfg.model).templates[1].numel
    per_layer = tokens * kept_bytes_per_token(cfg.model, 2) + layer_numel * 2 - tokens * cfg.model.hidden_size * 2
    grown = peaks[KEEP] - peaks[GPU]
    assert 0.5 * 4 * per_layer < grown <= 1.05 * 4 * per_layer, (grown, 4 * per_layer)


def test_every_attention_backend_the_gpu_offers_gives_the_same_step(tmp_path, shm_dir):
    cfg = _config(tmp_path, shm_dir, False)
    ref = _step(cfg, (GPU,) * 4, attention_backend="math")[0]["loss"]
    for backend in ("auto", "flash", "cudnn", "efficient"):
        try:
            loss = _step(cfg, (GPU,) * 4, attention_backend=backend)[0]["loss"]
        except RuntimeError as e:  # a kernel this GPU / torch build lacks: "No available kernel"
            assert "No available kernel" in str(e) or "cudnn" in str(e).lower(), e
            continue
        # bf16 attention in other summation orders: ~1e-3 relative on a loss of ~8
        assert abs(loss - ref) / ref < 5e-3, backend
