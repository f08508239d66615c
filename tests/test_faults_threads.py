"""An error in one of the compute worker's helper threads (the loader copying a unit to the device,
the releaser, the grad sender) ends the run in one sentence naming the thread, what it was doing
and the error's first line; the traceback goes to the run's log file only, and so do Ray's reports
of the failed calls nobody read, also those that come after the run has ended."""

import os
import queue
import threading
import uuid

import pytest
import ray

from megatrain_ray.engine.compute.compute_worker import ComputeWorker
from megatrain_ray.engine.prefetch.prefetcher import Prefetcher
from megatrain_ray.engine.schedule import Schedule
from megatrain_ray.engine.store.host_store import ParameterStore, StoreSpec
from megatrain_ray.errors import PipelineError
from megatrain_ray.data.loader import source_from_config
from megatrain_ray.model.layout import StoreLayout
from megatrain_ray.model.precision import resolve_precision
from megatrain_ray.orchestration import calls, console
from megatrain_ray.orchestration.resolve import Facts, resolve
from test_actplace import _config, finish_prefetch

CUDA_ERROR = ("CUDA error: invalid argument\nCUDA kernel errors might be asynchronously reported at some other API "
              "call, so the stacktrace below might be incorrect.\nFor debugging consider passing "
              "CUDA_LAUNCH_BLOCKING=1\n")
"""How torch words a CUDA error: its first line, then lines of advice."""


def test_a_loader_thread_error_is_one_sentence_naming_the_thread_and_the_copy(tmp_path, shm_dir):
    cfg = _config(tmp_path, shm_dir)
    spec = StoreSpec(cfg.model, resolve_precision(cfg.precision, "cpu"), shm_dir, os.getpid(), "th-" + uuid.uuid4().hex[:6])
    store = ParameterStore(spec, cfg.train.seed)
    depth = cfg.memory.buffer_depth_on("cpu")
    fetch_q, release_q, grad_q = queue.Queue(depth), queue.Queue(depth), queue.Queue()
    schedule = Schedule.build(StoreLayout.build(cfg.model), cfg.model.tie_word_embeddings, (), ())
    prefetcher = Prefetcher(spec, schedule, depth, fetch_q, release_q, cfg.cluster.actor_timeout_s)
    thread = threading.Thread(target=prefetcher.run, args=(0, 1), daemon=True)
    worker = None
    try:
        worker = ComputeWorker(spec, resolve(cfg, Facts("cpu")).compute, fetch_q, grad_q, release_q)
        plain = worker.backend.load

        def load(slot, host, label="", ranges=None):  # a backend whose copy of the second layer fails
            if label == "layers.1":
                raise RuntimeError(CUDA_ERROR)
            return plain(slot, host, label, ranges)

        worker.backend.load = load  # before any ticket: the prefetcher starts below
        thread.start()
        with pytest.raises(PipelineError) as info:
            worker.run_step(0, source_from_config(cfg).batch(0))
    finally:
        if worker is not None:
            worker.close()
        finish_prefetch(prefetcher, thread, fetch_q, release_q)
        store.close()
    assert str(info.value) == ("the compute worker's loader thread failed copying layers.1 to the device: "
                               "CUDA error: invalid argument")
    detail = calls.detail(info.value)
    assert "Traceback (most recent call last)" in detail and "CUDA_LAUNCH_BLOCKING" in detail
    assert "in _load_loop" in detail


def test_a_roles_error_reaches_the_driver_as_its_sentence_with_the_traceback_kept_apart(ray_cluster):
    @ray.remote(num_cpus=0)
    class Failing:
        def thread_error(self):
            error = PipelineError("the compute worker's loader thread failed copying layers.70 to the device: "
                                  "CUDA error: invalid argument")
            error.detail = "Traceback (most recent call last):\n  ...\nRuntimeError: " + CUDA_ERROR
            raise error

        def plain_error(self):
            raise RuntimeError(CUDA_ERROR)

    role = Failing.remote()
    try:
        with pytest.raises(PipelineError) as ours:
            calls.get(role.thread_error.remote(), "compute", 120)
        with pytest.raises(PipelineError) as plain:
            calls.get(role.plain_error.remote(), "compute", 120)
    finally:
        ray.kill(role, no_restart=True)
    assert str(ours.value) == ("the compute worker's loader thread failed copying layers.70 to the device: CUDA error: "
                               "invalid argument")
    assert "CUDA_LAUNCH_BLOCKING" in calls.detail(ours.value)
    assert str(plain.value) == "the compute actor failed: CUDA error: invalid argument"
    assert "CUDA_LAUNCH_BLOCKING" in calls.detail(plain.value) and "plain_error" in calls.detail(plain.value)


def test_rays_reports_after_a_failed_run_ended_go_to_its_file_until_another_run_starts(ray_cluster, tmp_path,
                                                                                       caplog):
    """Ray reports the error of a call nobody read when its reference is freed: after a role died that
    may be once the run has ended (its error printed, the process exiting)."""
    console.quiet()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with console.Console(lambda line: None) as out:
        out.attach(str(tmp_path / "a"))
        console.failed(out)
    # (Ray colours the name of the task that failed)
    ray._private.worker._unhandled_error_handler(ValueError("\x1b[36mray::GradientSink\x1b[39m the queued step's "
                                                            "error, freed later"))
    with console.Console(lambda line: None) as out:  # the next run: its own reports show
        out.attach(str(tmp_path / "b"))
    ray._private.worker._unhandled_error_handler(ValueError("after a run that did not fail"))
    shown = "\n".join(r.getMessage() for r in caplog.records)
    assert "freed later" not in shown and "after a run that did not fail" in shown
    kept = (tmp_path / "a" / console.LOG_FILE).read_text()
    assert "ray::GradientSink the queued step's error, freed later" in kept and "\x1b" not in kept, kept
    assert "after a run that did not fail" not in (tmp_path / "b" / console.LOG_FILE).read_text()
