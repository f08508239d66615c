"""Ray jobs end to end: ``ray start --head``, ``ray job submit``, ``ray job stop``, with token auth on.

A separate head node is started for this module, on free ports and its own temp dir (so it never
becomes the "current cluster" that another ``ray.init()`` on this machine would join), with
``RAY_AUTH_MODE=token``: the job CLI authenticates with the token Ray keeps in ~/.ray. It is
stopped by terminating its own ``ray start --block`` process rather than ``ray stop``, which would
kill every Ray on the machine, the test session's included.
"""

import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from megatrain_ray.io import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="token", RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0", **extra)
    return env


@pytest.fixture(scope="module")
def head():
    """A Ray head node with the job server on 127.0.0.1; yields the job server's address."""
    if shutil.which("ray") is None:
        pytest.skip("the ray CLI is not on PATH")
    temp = tempfile.mkdtemp(prefix="mtr-", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    dashboard = _free_port()
    log = open(os.path.join(temp, "head.log"), "w")
    proc = subprocess.Popen(
        ["ray", "start", "--head", "--block", f"--port={_free_port()}", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dashboard}", f"--dashboard-agent-listen-port={_free_port()}",
         f"--ray-client-server-port={_free_port()}", "--num-cpus=4", "--num-gpus=0",
         "--object-store-memory=200000000", f"--temp-dir={temp}"],
        env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + 120
        while True:  # the job server answers once the head and its agent are up
            assert proc.poll() is None, open(log.name).read()[-3000:]
            status = subprocess.run(["ray", "job", "list", "--address", address], env=_env(),
                                    capture_output=True, text=True)
            if status.returncode == 0:
                break
            assert time.monotonic() < deadline, status.stderr[-3000:]
            time.sleep(2)
        yield address
    finally:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pid in _processes_of(temp):  # anything it left behind, found by its unique temp dir
            os.kill(pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _processes_of(temp: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if temp in cmdline and int(entry) != os.getpid():
                pids.append(int(entry))
    return pids


def _ray(*args, timeout=300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["ray", *args], env=_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          **kwargs)


def _submit(address, job_id, *train_args, wait=True, script="jobs/train.py") -> subprocess.CompletedProcess:
    runtime_env = {"excludes": ["runs", ".git", ".whl", "benchmarks", "*.png"],
                   "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "120"}}  # time to checkpoint on `ray job stop`
    return _ray("job", "submit", "--address", address, "--submission-id", job_id, "--working-dir", ".",
                "--runtime-env-json", json.dumps(runtime_env), *([] if wait else ["--no-wait"]), "--",
                "python", script, *train_args)


def _status(address, job_id) -> str:
    """The job's status as `ray job status` prints it: SUCCEEDED, STOPPED, FAILED, RUNNING, PENDING."""
    proc = _ray("job", "status", "--address", address, job_id)
    out = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    for pattern, status in ((r"Job '[^']+' succeeded", "SUCCEEDED"), (r"Job '[^']+' was stopped", "STOPPED"),
                            (r"Job '[^']+' failed", "FAILED")):
        if re.search(pattern, out):
            return status
    m = re.search(r"Status for job '[^']+': (?:JobStatus\.)?(\w+)", out)
    return m.group(1) if m else out


@pytest.fixture(scope="module")
def long_job(head, tmp_path_factory, shm_dirs):
    """A long training job, submitted without waiting so it starts while the short one runs."""
    base = tmp_path_factory.mktemp("long-job")
    with shm_dirs() as shm_dir:
        run_dir = base / "runs"
        proc = _submit(head, "megatrain-stop", "--set", "train.steps=100000", "--set", "runtime.device=cpu",
                       "--set", "train.checkpoint_every=0", "--set", f"runtime.shm_dir={shm_dir}",
                       "--set", f"runtime.run_dir={run_dir}", wait=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        try:
            yield "megatrain-stop", shm_dir, run_dir
        finally:
            if _status(head, "megatrain-stop") in ("RUNNING", "PENDING"):
                _ray("job", "stop", "--address", head, "megatrain-stop")


def test_job_submit_runs_to_succeeded_with_logs(head, long_job, shm_dir, tmp_path):
    proc = _submit(head, "megatrain-ok", "--set", "train.steps=3", "--set", "runtime.device=cpu",
                   "--set", f"runtime.shm_dir={shm_dir}", "--set", f"runtime.run_dir={tmp_path}")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    logs = proc.stdout + proc.stderr
    assert re.search(r"step\s+3/3 \| loss", logs), logs[-4000:]  # the job's output was streamed
    assert _status(head, "megatrain-ok") == "SUCCEEDED"
    (run,) = os.listdir(tmp_path)
    rows = [json.loads(line) for line in open(tmp_path / run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert os.path.isfile(tmp_path / run / "final" / "model.safetensors.index.json")
    assert os.listdir(shm_dir) == []


def test_bench_job_joins_the_cluster_and_writes_its_report(head, long_job, shm_dir, tmp_path):
    """jobs/bench.py: the benchmark's pipeline runs on the job's cluster (RAY_ADDRESS) beside the
    long training job, and its table and JSON come out."""
    out = tmp_path / "bench-out"
    proc = _submit(head, "megatrain-bench", "--preset", "tiny", "--layers", "2", "--tokens", "1024",
                   "--seq-len", "128", "--micro-batches", "2", "--steps", "3", "--out", str(out),
                   "--set", f"runtime.shm_dir={shm_dir}", "--set", f"runtime.run_dir={tmp_path}/runs",
                   script="jobs/bench.py")
    logs = proc.stdout + proc.stderr
    assert proc.returncode == 0, logs[-4000:]
    assert re.search(r"^megatrain_ray\s+[0-9.]+", logs, re.M), logs[-4000:]
    report = json.loads((out / "bench-tiny.json").read_text())
    assert len(report["systems"]["megatrain_ray"]["losses"]) == 3
    assert _status(head, "megatrain-bench") == "SUCCEEDED"
    assert os.listdir(shm_dir) == []


def test_job_stop_checkpoints_and_exits_cleanly(head, long_job):
    job, shm_dir, run_dir = long_job
    deadline = time.monotonic() + 240
    while not re.search(r"step\s+2/100000", _ray("job", "logs", "--address", head, job).stdout):
        assert time.monotonic() < deadline and _status(head, job) in ("RUNNING", "PENDING")
        time.sleep(2)
    stop = _ray("job", "stop", "--address", head, job)
    assert stop.returncode == 0, stop.stderr[-3000:]
    assert _status(head, job) == "STOPPED"
    logs = _ray("job", "logs", "--address", head, job).stdout
    m = re.search(r"checkpoint: step (\d+) saved to (\S+)", logs)
    assert m, logs[-4000:]
    step, path = int(m.group(1)), m.group(2)
    assert step >= 2
    assert "interrupted: the run was stopped after saving a checkpoint" in logs
    assert "Traceback" not in logs
    # The checkpoint is complete and consistent, and everything else was cleaned up.
    meta = checkpoint.read_meta(path)
    assert meta["step"] == step and set(meta["versions"].values()) == {step}
    checkpoint.check_files(path)
    assert glob.glob(str(run_dir / "*" / "checkpoints" / "step-*")) == [path]
    assert os.listdir(shm_dir) == []
