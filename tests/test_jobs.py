"""Ray jobs end to end: ``ray start --head``, ``ray job submit``, ``ray job stop``, with token auth on,
and plain ``megatrain-ray train`` joining the running head.

A separate head node is started for this module as the README says (``RAY_AUTH_MODE=token``, a
token made by ``ray get-auth-token --generate``), but on free ports, with its own Ray temp dir
(``RAY_TMPDIR``: only processes given it see this cluster as the "current cluster" that
``ray.init()`` joins) and its own home (where the token is kept and where jobs write their runs).
It is stopped by terminating its own ``ray start --block`` process rather than ``ray stop``,
which would kill every Ray on the machine, the test session's included.
"""

import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from processes import finish
from test_cli import RAY_NOISE  # the Ray lines no run may print

from megatrain_ray.io import checkpoint

pytestmark = pytest.mark.slow  # Ray clusters started with `ray start`, jobs submitted through the CLI: minutes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAD_ENV: dict[str, str] = {}
"""HOME and RAY_TMPDIR of the module's head, set by the ``head`` fixture for every command here."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="token", RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0", **HEAD_ENV, **extra)
    return env


@pytest.fixture(scope="module")
def head():
    """A Ray head node with the job server on 127.0.0.1; yields the job server's address."""
    if shutil.which("ray") is None:
        pytest.skip("the ray CLI is not on PATH")
    temp = tempfile.mkdtemp(prefix="mtr-", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    HEAD_ENV.update(HOME=os.path.join(temp, "home"), RAY_TMPDIR=temp)
    token = subprocess.run(["ray", "get-auth-token", "--generate"], env=_env(), capture_output=True, text=True)
    assert token.returncode == 0 and os.path.isfile(os.path.join(temp, "home", ".ray", "auth_token")), token.stderr
    dashboard = _free_port()
    log = open(os.path.join(temp, "head.log"), "w")
    proc = subprocess.Popen(
        ["ray", "start", "--head", "--block", f"--port={_free_port()}", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dashboard}", f"--dashboard-agent-listen-port={_free_port()}",
         f"--ray-client-server-port={_free_port()}", "--num-cpus=4", "--num-gpus=0",
         "--object-store-memory=200000000", f"--temp-dir={temp}/ray"],
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
        HEAD_ENV.clear()


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
        proc = _submit(head, "megatrain-stop", "--set", "train.steps=100000", "--set", "compute.device=cpu",
                       "--set", "train.checkpoint_every=0", "--set", f"memory.shm_dir={shm_dir}",
                       "--set", f"train.run_dir={run_dir}", wait=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        try:
            yield "megatrain-stop", shm_dir, run_dir
        finally:
            if _status(head, "megatrain-stop") in ("RUNNING", "PENDING"):
                _ray("job", "stop", "--address", head, "megatrain-stop")


def test_job_submit_runs_to_succeeded_with_logs(head, long_job, shm_dir, tmp_path):
    proc = _submit(head, "megatrain-ok", "--set", "train.steps=3", "--set", "compute.device=cpu",
                   "--set", f"memory.shm_dir={shm_dir}", "--set", f"train.run_dir={tmp_path}")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    logs = proc.stdout + proc.stderr
    assert re.search(r"step\s+3/3 \| loss", logs), logs[-4000:]  # the job's output was streamed
    assert _status(head, "megatrain-ok") == "SUCCEEDED"
    (run,) = os.listdir(tmp_path)
    rows = [json.loads(line) for line in open(tmp_path / run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert os.path.isfile(tmp_path / run / "final" / "model.safetensors.index.json")
    assert os.listdir(shm_dir) == []


def test_documented_job_command_writes_the_run_under_home(head, shm_dir):
    """The README's form (``jobs/train.py --config configs/tiny.yaml``, a path in the uploaded working
    directory), from a shell with RAY_AUTH_MODE=token and the head's token: no --address, no runtime
    env, a relative train.run_dir. The run lands in ~/megatrain-ray/runs (the job's working
    directory is Ray's temporary copy), and the job says so first."""
    proc = _ray("job", "submit", "--working-dir", ".", "--", "python", "jobs/train.py", "--config", "configs/tiny.yaml",
                "--set", "train.steps=3", "--set", "compute.device=cpu", "--set", f"memory.shm_dir={shm_dir}")
    logs = proc.stdout + proc.stderr
    assert proc.returncode == 0, logs[-4000:]
    runs = os.path.join(HEAD_ENV["HOME"], "megatrain-ray", "runs")
    (run,) = [name for name in os.listdir(runs) if name != "data-cache"]
    assert re.search(r"^ray job: train.run_dir 'runs' is taken from ~/megatrain-ray, not from Ray's temporary "
                     rf"copy of the working directory: {re.escape(runs)} ", logs, re.M), logs[-4000:]
    assert f"config, metrics, log, checkpoints and weights go to {os.path.join(runs, run)}" in logs
    assert [json.loads(line)["step"] for line in open(os.path.join(runs, run, "metrics.jsonl"))] == [1, 2, 3]
    assert os.path.isfile(os.path.join(runs, run, "final", "model.safetensors.index.json"))
    for noise in RAY_NOISE:
        assert noise not in logs, logs[-4000:]
    assert os.listdir(shm_dir) == []


def test_train_joins_the_running_head(head, tmp_path, shm_dir):
    """Plain ``megatrain-ray train`` with the head up, from a shell with only the head's token file
    (no RAY_AUTH_MODE): it joins that cluster (said in one line; its driver logs into the head's
    session) instead of failing on object_store_memory, trains, and prints none of Ray's noise, also
    while a Ray Data pool tokenizes its data."""
    corpus = tmp_path / "corpus.jsonl"
    words = "the quick brown fox jumps over a lazy dog while seven green birds sing".split()
    corpus.write_text("".join(json.dumps({"text": " ".join(words[(i * 7 + j) % len(words)] for j in range(50))})
                              + "\n" for i in range(300)))
    env = {k: v for k, v in _env().items() if k != "RAY_AUTH_MODE"}
    proc = subprocess.Popen([sys.executable, "-m", "megatrain_ray.cli", "train", "--set", "train.steps=3",
                             "--set", "compute.device=cpu", "--set", f"memory.shm_dir={shm_dir}",
                             "--set", f"data.path={corpus}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    stdout, stderr = finish(proc, 300)
    out = stdout + stderr
    assert proc.returncode == 0, out[-4000:]
    m = re.search(r"^joining the Ray cluster already running at (\S+); set cluster.ray_address=local to start a "
                  "private one$", stdout, re.M)
    assert m, out[-4000:]
    assert open(os.path.join(HEAD_ENV["RAY_TMPDIR"], "ray", "ray_current_cluster")).read().strip() == m.group(1)
    logs = os.path.join(HEAD_ENV["RAY_TMPDIR"], "ray", "session_latest", "logs")
    assert glob.glob(os.path.join(logs, f"python-core-driver-*_{proc.pid}.log")), sorted(os.listdir(logs))
    for noise in RAY_NOISE:
        assert noise not in out, out[-4000:]
    (run,) = [p for p in (tmp_path / "runs").iterdir() if p.name != "data-cache"]
    assert [json.loads(line)["step"] for line in open(run / "metrics.jsonl")] == [1, 2, 3]
    assert os.listdir(shm_dir) == []


def test_ray_address_chooses_the_cluster(head, monkeypatch):
    """What connect() would do, without connecting: the head found through the Ray temp dir; a
    private Ray with cluster.ray_address=local; RAY_ADDRESS (a job's) or a given address as is."""
    from megatrain_ray.orchestration import cluster
    from megatrain_ray.config import ClusterSection

    monkeypatch.setenv("RAY_TMPDIR", HEAD_ENV["RAY_TMPDIR"])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    address = open(os.path.join(HEAD_ENV["RAY_TMPDIR"], "ray", "ray_current_cluster")).read().strip()
    assert cluster.cluster_to_join(ClusterSection()) == (address, True)
    assert cluster.cluster_to_join(ClusterSection(ray_address="local")) == (None, False)
    assert cluster.cluster_to_join(ClusterSection(ray_address="10.0.0.1:6379")) == ("10.0.0.1:6379", False)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert cluster.cluster_to_join(ClusterSection()) == ("10.0.0.2:6379", False)
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setenv("RAY_TMPDIR", os.path.join(HEAD_ENV["RAY_TMPDIR"], "elsewhere"))  # no cluster recorded
    assert cluster.cluster_to_join(ClusterSection()) == (None, False)


def test_bench_job_joins_the_cluster_and_writes_its_report(head, long_job, shm_dir, tmp_path):
    """jobs/bench.py: the benchmark's pipeline runs on the job's cluster (RAY_ADDRESS) beside the
    long training job, and its table and JSON come out, under ~/megatrain-ray for a relative --out."""
    proc = _submit(head, "megatrain-bench", "--preset", "tiny", "--layers", "2", "--tokens", "1024",
                   "--seq-len", "128", "--micro-batches", "2", "--steps", "3", "--out", "bench-out",
                   "--set", f"memory.shm_dir={shm_dir}", "--set", f"train.run_dir={tmp_path}/runs",
                   script="jobs/bench.py")
    logs = proc.stdout + proc.stderr
    assert proc.returncode == 0, logs[-4000:]
    assert re.search(r"^megatrain_ray\s+[0-9.]+", logs, re.M), logs[-4000:]
    out = os.path.join(HEAD_ENV["HOME"], "megatrain-ray", "bench-out")
    assert "ray job: --out 'bench-out' is taken from ~/megatrain-ray" in logs
    report = json.loads(open(os.path.join(out, "bench-tiny.json")).read())
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
    # `ray job stop` sends SIGTERM (to the job's process group): the interrupt line says that a repeated
    # one waits for the save, never that Ctrl-C would stop it; every row written has its step line.
    (said,) = re.findall(r"interrupted: finishing the steps up to \d+ and saving a checkpoint.*", logs)
    assert said.endswith("(a repeated SIGTERM waits for it)") and "Ctrl-C" not in logs, said
    (metrics,) = glob.glob(str(run_dir / "*" / "metrics.jsonl"))
    rows = [json.loads(line)["step"] for line in open(metrics)]
    assert [int(n) for n in re.findall(r"step\s+(\d+)/100000 \| loss", logs)] == rows and rows[-1] == step, logs[-4000:]
    # The checkpoint is complete and consistent, and everything else was cleaned up.
    meta = checkpoint.read_meta(path)
    assert meta["step"] == step and set(meta["versions"].values()) == {step}
    checkpoint.check_files(path)
    assert glob.glob(str(run_dir / "*" / "checkpoints" / "step-*")) == [path]
    assert os.listdir(shm_dir) == []
