"""Faults noticed in seconds and reported right, with real signals to real processes.

- A role that dies mid-step — here the parameter store, which has no call in flight and went
  unnoticed until the final export — is noticed within a second or two by the health checks, and
  the run restarts from its newest checkpoint; the restart counts right afterwards: "done: N steps"
  counts the run's steps once, metrics.jsonl holds each step once, and the reason given for a
  ``kill -9`` is a kill, not Ray's paragraph guessing at the OOM killer.
- A role whose process is frozen (SIGSTOP) is noticed within cluster.health_timeout_s (idle roles)
  or the next health check (busy ones on this node), not after a queue timeout of minutes.
- ``kill -9`` of a real driver: the run's shared-memory segments are gone within seconds and so are
  the role processes (the reapers of :mod:`megatrain_ray.engine.store.reaper`).
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import psutil
import pytest
import ray

from megatrain_ray.config import load_config
from megatrain_ray.engine.store import reaper
from megatrain_ray.errors import ActorDied
from megatrain_ray.orchestration.driver import Driver, RunResult
from megatrain_ray.orchestration.metrics import RunMetrics
from megatrain_ray.orchestration.pipeline import _rewind, train
from megatrain_ray.orchestration.queues import QueueClient, QueueHost
from resolved import resolved


def _cfg(shm_dir, run_dir, *extra):
    return load_config(None, [f"memory.shm_dir={shm_dir}", f"train.run_dir={run_dir}", "compute.device=cpu",
                              "train.steps=8", "train.seq_len=32", "train.micro_batch_size=2",
                              "cluster.actor_timeout_s=300", *extra])


def _role_pid(cls: str) -> int:
    """The process of this test session's (only) live actor of class ``cls``: a descendant of this process."""
    found = [p.pid for p in psutil.Process().children(recursive=True)
             if _cmdline(p).startswith(f"ray::{cls}")]
    assert len(found) == 1, found
    return found[0]


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _signal_at_step(step: int, cls: str, sig: int, lines: list, events: dict):
    """A log callback that records lines (with their time) and sends ``sig`` to the ``cls`` actor at ``step``."""
    def log(line):
        lines.append((time.monotonic(), line))
        if re.match(rf"step\s+{step}/", line) and "pid" not in events:
            events["pid"] = _role_pid(cls)
            os.kill(events["pid"], sig)
            events["sent"] = time.monotonic()
    return log


@pytest.mark.slow  # kills a role mid-run and restarts the pipeline
def test_a_store_killed_mid_run_restarts_within_seconds_and_is_reported_once(ray_cluster, shm_dir, tmp_path):
    lines, events = [], {}
    steps = 30
    result = train(_cfg(shm_dir, tmp_path, "train.checkpoint_every=2", "cluster.max_restarts=1", f"train.steps={steps}"),
                   log=_signal_at_step(3, "ParameterStore", signal.SIGKILL, lines, events))
    text = [line for _, line in lines]
    (restart,) = [(t, line) for t, line in lines if line.startswith("restart ")]
    assert restart[1].startswith("restart 1 of 1: the store actor died (its process was killed by a signal or "
                                 "crashed, not for lack of memory (the kernel's OOM-kill count did not change)); ")
    assert "OOM killer due to" not in restart[1] and "Some common causes" not in restart[1]
    # Seconds, teardown of the old pipeline included (a queue timeout would be cluster.actor_timeout_s, 300 s).
    assert restart[0] - events["sent"] < 30, "the store's death was not noticed within seconds"
    # Noticed within seconds: the driver stopped logging steps within 5 s of the kill (this tiny model's
    # steps take ~0.2 s, so a few still finished meanwhile: a ping a second, and Ray's notice of the death).
    between = [t for t, line in lines if events["sent"] < t < restart[0] and re.match(r"step\s+\d+/", line)]
    assert not between or between[-1] - events["sent"] < 5, [t - events["sent"] for t in between]
    assert "restarting the pipeline from " in restart[1] and re.search(r"/checkpoints/step-0000\d\d ", restart[1])
    # Reported once: the run's steps, each step's row once, the losses of steps 0..29.
    (done,) = [line for line in text if line.startswith("done: ")]
    repeated = result.repeated_steps
    assert result.restarts == 1  # repeated: 0 when the kill came just after a checkpoint's boundary
    assert done.startswith(f"done: {steps} steps (after 1 restart, which trained {repeated} "
                           f"step{'' if repeated == 1 else 's'} twice), final loss "), done
    rows = [json.loads(line) for line in open(os.path.join(result.run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["loss"] for r in rows] == result.losses and len(result.grad_norms) == steps
    assert os.listdir(shm_dir) == []


@pytest.mark.slow  # freezes roles of a running pipeline
@pytest.mark.parametrize("cls,role,timeout", [("ParameterStore", "store", 4), ("ComputeWorker", "compute", 60)])
def test_a_frozen_role_is_noticed_within_the_health_timeout(cls, role, timeout, ray_cluster, shm_dir, tmp_path):
    lines, events = [], {}
    started = time.monotonic()
    try:
        with pytest.raises(ActorDied) as info:
            train(_cfg(shm_dir, tmp_path, f"cluster.health_timeout_s={timeout}", "train.steps=100000"),
                  log=_signal_at_step(2, cls, signal.SIGSTOP, lines, events))
    finally:
        if "pid" in events:
            try:
                os.kill(events["pid"], signal.SIGCONT)  # if anything is left of it, let it die
            except ProcessLookupError:
                pass
    noticed = time.monotonic() - events["sent"]  # teardown included; a queue timeout would be 300 s
    message = str(info.value)
    if role == "store":  # idle: its ping goes unanswered
        assert message.startswith(f"the store actor has not answered a health check for {timeout} s, so it hangs "
                                  f"(process {events['pid']}); "), message
        assert timeout <= noticed < timeout + 30, noticed
    else:  # busy: its process is seen stopped at the next check
        assert message.startswith(f"the compute actor's process {events['pid']} is stopped, so the run cannot go "
                                  "on; "), message
        assert noticed < 30, noticed
    assert "\n" not in message and time.monotonic() - started < 300
    assert os.listdir(shm_dir) == []


# ---------------------------------------------------------------------------------------------
# The reaper, then a real driver killed with -9.

def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _wait_for(condition, seconds: float) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < seconds, f"not within {seconds} s"
        time.sleep(0.05)
    return time.monotonic() - start


def _reapers(*patterns: str) -> list[psutil.Process]:
    """The reaper processes watching ``patterns`` (detached: found by their command line)."""
    found = []
    for p in psutil.process_iter():
        line = _cmdline(p)
        if "reaper.py" in line and json.dumps(list(patterns)) in line:
            found.append(p)
    return found


def _polling(p: psutil.Process) -> bool:
    """Whether reaper ``p`` waits in its poll's sleep, so has looked at its processes and paths once and
    found nothing to do (a reaper that reaps unlinks and exits instead of sleeping): the kernel says
    where a process waits (/proc/PID/wchan, a nanosleep; 0 while it runs); where it hides that (0
    always), whether it sleeps."""
    try:
        with open(f"/proc/{p.pid}/wchan") as f:
            where = f.read().strip()
    except OSError:
        where = ""
    if where in ("", "0"):
        return p.status() == psutil.STATUS_SLEEPING
    return "nanosleep" in where


def test_the_reaper_unlinks_when_its_process_dies_and_leaves_when_released(tmp_path):
    owner = _sleeper()
    paths = [tmp_path / f"megatrain-1-run-{k}" for k in ("master", "versions")]
    other = tmp_path / "megatrain-1-other-master"
    for p in (*paths, other):
        p.write_bytes(b"\0" * 64)
    reaper.start([str(p) for p in paths], [owner.pid])
    (watching,) = _reapers(*map(str, paths))
    _wait_for(lambda: _polling(watching), 30)  # it has looked once
    assert all(p.exists() for p in paths)  # the owner lives: nothing happens
    owner.kill()  # a zombie until reaped: counts as dead
    # on the death (well before the sleeper's own end at 120 s), however busy the machine
    _wait_for(lambda: not any(p.exists() for p in paths), 30)
    assert other.exists()
    owner.wait()

    # A lease released: the reaper goes without reaping, even when its process dies afterwards.
    owner = _sleeper()
    pattern = str(tmp_path / "megatrain-1-run2-*")
    lease = reaper.start([pattern], [owner.pid], until_gone=False, lease=True)
    (released,) = _reapers(pattern)
    reaper.release(lease)
    released.wait(timeout=60)  # it went (no wait on its timing: on its exit)
    (tmp_path / "megatrain-1-run2-master").write_bytes(b"\0")
    owner.kill()
    owner.wait()
    assert not _reapers(pattern) and (tmp_path / "megatrain-1-run2-master").exists()

    # The lease's end of file (its holder died without releasing it) reaps at once.
    lease = reaper.start([pattern], [os.getpid()], until_gone=False, lease=True)
    lease.close()
    _wait_for(lambda: not (tmp_path / "megatrain-1-run2-master").exists(), 30)  # not on a timer of its own


def test_the_reaper_goes_away_once_the_segments_are_gone(tmp_path, monkeypatch):
    path = tmp_path / "megatrain-1-run-master"
    path.write_bytes(b"\0")
    polled = threading.Event()

    def poll_sleep(seconds: float) -> None:  # the watch's sleep between looks: it has looked once
        polled.set()
        time.sleep(seconds)

    monkeypatch.setattr(reaper, "time", SimpleNamespace(sleep=poll_sleep))
    done = []
    thread = threading.Thread(target=lambda: done.append(reaper.watch([str(path)], [os.getpid()])), daemon=True)
    thread.start()
    assert polled.wait(timeout=30)
    assert not done
    path.unlink()
    thread.join(timeout=30)  # on its next look, however busy the machine
    assert done == ["gone"]


@pytest.mark.slow  # a driver process killed with -9
def test_a_driver_killed_with_minus_9_leaves_no_segment_and_no_role(shm_dir, tmp_path):
    """The CLI with a private Ray, killed with SIGKILL once every role is stepping."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = open(tmp_path / "out.txt", "w")
    proc = subprocess.Popen([sys.executable, "-m", "megatrain_ray.cli", "train", "--set", f"memory.shm_dir={shm_dir}",
                             "--set", "train.steps=100000", "--set", f"train.run_dir={tmp_path / 'runs'}",
                             "--set", "cluster.ray_address=local"], cwd=tmp_path, env=env, stdout=out,
                            stderr=subprocess.STDOUT)
    roles = []
    try:
        _wait_for(lambda: proc.poll() is not None or "step     2/" in (tmp_path / "out.txt").read_text(), 400)
        assert proc.poll() is None, (tmp_path / "out.txt").read_text()[-3000:]
        roles = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if _cmdline(p).startswith(("ray::ParameterStore", "ray::Prefetcher", "ray::ComputeWorker",
                                            "ray::GradientSink", "ray::BatchSource", "ray::QueueHost"))]
        assert {_cmdline(p).split()[0].split(".")[0] for p in roles} >= {
            "ray::ParameterStore", "ray::Prefetcher", "ray::ComputeWorker", "ray::GradientSink", "ray::QueueHost"}, roles
        assert len(os.listdir(shm_dir)) == 5
        proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        proc.wait()
        shm_s = _wait_for(lambda: os.listdir(shm_dir) == [], 60)  # on the death, however busy the machine
        _wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in roles), 60)
        print(f"segments gone {shm_s:.1f} s, roles gone {time.monotonic() - killed:.1f} s after the kill")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in roles:  # only this test's own processes, by id
            try:
                p.kill()
            except psutil.Error:
                pass


def test_a_kill_is_reported_as_a_kill_and_a_kernel_oom_kill_as_one():
    """Ray's text for a worker that vanished (as Ray 2.60 words it) guesses at the OOM killer; the
    error says what happened instead, from the kernel's OOM-kill count since the attempt began."""
    import ray.exceptions

    from megatrain_ray.orchestration import calls

    ray_text = ("The actor died unexpectedly before finishing this task.\n\tclass_name: ParameterStore\n\tpid: 123\n"
                "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
                "detail: Worker unexpectedly exits with a connection error code 2. End of file. Some common causes "
                "include: (1) the process was killed by the OOM killer due to high memory usage, (2) ray stop --force "
                "was called, or (3) the worker crashed unexpectedly due to SIGSEGV or another unexpected error.")
    err = ray.exceptions.RayActorError(error_msg=ray_text)
    if calls.oom_kills() is None:
        pytest.skip("no /proc/vmstat oom_kill counter here")
    calls.mark_oom_kills()
    message = str(calls.actor_error(err, "store"))
    assert message == ("the store actor died (its process was killed by a signal or crashed, not for lack of memory "
                       "(the kernel's OOM-kill count did not change)); see its log in the Ray dashboard or "
                       f"{calls.ray_logs()}.")  # the session's own log directory, under RAY_TMPDIR where set
    calls._OOM_KILLS[0] = calls.oom_kills() - 2  # as if the kernel had killed two processes meanwhile
    message = str(calls.actor_error(err, "store"))
    assert message.startswith("the store actor died (its process was killed, and the kernel's OOM killer ended 2 "
                              "process(es) on this machine meanwhile: host memory ran out; see what the run needs "
                              "with `megatrain-ray plan`)"), message
    calls.mark_oom_kills()
    killed = ray.exceptions.RayActorError(error_msg="The actor died unexpectedly before finishing this task.\n"
                                                    "The actor is dead because it was killed by `ray.kill`.")
    assert str(calls.actor_error(killed, "compute")).startswith(
        "the compute actor died (The actor is dead because it was killed by `ray.kill`.); ")


def test_a_restart_from_a_checkpoint_ahead_of_the_rows_keeps_the_trained_steps_and_names_the_unreported(tmp_path):
    # Steps 0-5 collected, rows (and grad norms) written for 0-3 (rows 1-4: a row counts the updates done);
    # the sink had saved boundary 6 when the queue host died with the stats of steps 4 and 5: restart from
    # 6, keep what is known, leave no row made up.
    result = RunResult(run_id="r", run_dir=str(tmp_path), final_dir="", losses=[5.0, 4.0, 3.0, 2.0, 1.5, 1.25],
                       grad_norms=[1.0, 0.9, 0.8, 0.7], fetches=[{"h2d": k} for k in range(6)])
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 5)))
    assert _rewind(result, 6) == [4, 5]
    assert result.losses == [5.0, 4.0, 3.0, 2.0, 1.5, 1.25] and result.fetches[5] == {"h2d": 5}
    assert result.grad_norms[:4] == [1.0, 0.9, 0.8, 0.7] and all(math.isnan(g) for g in result.grad_norms[4:])
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert (result.restarts, result.repeated_steps) == (1, 0)
    # Behind the rows (the usual case): steps 4 and 5 are trained again, and forgotten until then.
    assert _rewind(result, 2) == [] and result.losses == [5.0, 4.0] and result.grad_norms == [1.0, 0.9]
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [1, 2]
    assert (result.restarts, result.repeated_steps) == (2, 4)


def test_after_a_death_the_driver_records_the_finished_steps_and_the_stats_left_on_the_queue(ray_cluster, tmp_path):
    # What the driver had not read when a role died: step 4 finished on the (only) worker, the sink had
    # put the stats of steps 3 and 4 and a checkpoint notice, step 5 never finished (its worker died).
    @ray.remote(num_cpus=0)
    def finished(step):
        return {"step": step, "loss": 2.0 - step / 10, "tokens": 64, "start": 0.0, "step_s": 0.1,
                "fetches": {"h2d": 4}, "intervals": []}

    @ray.remote(num_cpus=0, max_retries=0)
    def died():
        os._exit(1)

    host = ray.remote(QueueHost).options(num_cpus=0).remote()
    stats_q = QueueClient(host, "stats")
    for step in (3, 4):
        stats_q.put({"step": step, "grad_norm": 1.0 + step, "lr": 1e-3, "update_busy_s": 0.01, "intervals": []})
    stats_q.put({"checkpoint": "ckpt/step-000005", "step": 5, "save_s": 0.1})
    cfg = _cfg("/dev/shm", tmp_path, "train.steps=8")
    head = SimpleNamespace(stats_q=stats_q, grad_q=QueueClient(host, "grad"), fetch_qs=[QueueClient(host, "fetch-0")])
    roles = SimpleNamespace(head=head, computes=[None])
    result = RunResult(run_id="r", run_dir=str(tmp_path), final_dir="", losses=[3.0, 2.9, 2.8, 2.7],
                       grad_norms=[1.0, 1.1, 1.2], fetches=[{}] * 4)
    lines = []
    with open(tmp_path / "metrics.jsonl", "a") as f:
        driver = Driver(resolved(cfg), roles, {}, None, result, f, RunMetrics("r", cfg.model, 32, 0), lines.append)
        driver.outputs[3] = ray.get(finished.remote(3))  # collected; its stats were still on the queue
        driver.submitted = {4: [finished.remote(4)], 5: [died.remote()], 6: [finished.remote(6)]}
        driver._salvage(within=10)
    ray.kill(host, no_restart=True)
    assert result.losses == [3.0, 2.9, 2.8, 2.7, 1.6] and result.grad_norms == [1.0, 1.1, 1.2, 4.0, 5.0]
    assert result.checkpoints == ["ckpt/step-000005"] and sorted(driver.submitted) == [5, 6]  # 6: after 5, unread
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [4, 5]


def test_a_line_that_fails_loses_no_stats_of_its_batch(tmp_path):
    # The sink's messages come in batches (a checkpoint notice, then the stats of the next step): an
    # interrupt raised while the notice's line is said (a test's log, as Ctrl-C at that instant) must
    # leave the step's stats recorded, so its row is still written when the run stops.
    cfg = _cfg("/dev/shm", tmp_path, "train.steps=8")
    roles = SimpleNamespace(head=SimpleNamespace(stats_q=None, grad_q=None, fetch_qs=[]), computes=[None])
    result = RunResult(run_id="r", run_dir=str(tmp_path), final_dir="")
    lines = []

    def log(line):
        lines.append(line)
        if line.startswith("checkpoint: step 2 saved"):
            raise KeyboardInterrupt

    with open(tmp_path / "metrics.jsonl", "a") as f:
        driver = Driver(resolved(cfg), roles, {}, None, result, f, RunMetrics("r", cfg.model, 32, 0), log)
        with pytest.raises(KeyboardInterrupt):
            driver._handle([{"checkpoint": "ckpt/step-000002", "step": 2, "save_s": 0.1},
                            {"step": 3, "grad_norm": 4.0, "lr": 1e-3, "update_busy_s": 0.01, "intervals": []}])
    assert result.checkpoints == ["ckpt/step-000002"] and sorted(driver.stats) == [3]
