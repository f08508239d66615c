"""Ray itself dying under a run: a real ``ray start --head`` cluster of this test's own (its own
temporary directory and port), a real ``megatrain-ray train`` joined to it, and ``kill -9`` of the
cluster's GCS and raylet processes. The user reads one line of ours, within seconds, that says
Ray went away and how to go on — not Ray's "Failed to connect to GCS within 60 seconds".

A node of a two-node cluster (``ray.cluster_utils``) lost mid-run, a replacement joining: the
failures it causes on the other node (a collective whose peer is gone, a fetch cut short) are
traced to the role that died with it, and the run restarts from its newest checkpoint; the
terminal shows the run's lines and that one restart sentence, Ray's and gloo's accounts of the loss
are in the run's log file.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _of_cluster(temp: str) -> list[psutil.Process]:
    """The processes of the cluster started under ``temp`` (their command lines name it), and their children."""
    found = {}
    for p in psutil.process_iter():
        if temp in _cmdline(p):
            found[p.pid] = p
            try:
                found.update({c.pid: c for c in p.children(recursive=True)})
            except psutil.Error:
                pass
    return list(found.values())


def _stop(procs: list[psutil.Process]) -> None:
    for p in procs:  # only this test's own cluster's processes, by id
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=30)


@pytest.mark.slow  # a Ray cluster of its own, killed under a running job
def test_ray_killed_under_a_running_run_is_one_line_of_ours_within_seconds(shm_dir, tmp_path):
    temp = tempfile.mkdtemp(prefix="mt-ray-", dir="/tmp")  # short: Ray's socket paths live under it
    port = _free_port()
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_AUTH_MODE": "disabled",
           "PYTHONPATH": ROOT}
    cluster = []
    proc = None
    try:
        subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", f"--port={port}",
                        "--num-cpus=8", "--num-gpus=0", "--include-dashboard=false", f"--temp-dir={temp}",
                        "--disable-usage-stats"], env=env, check=True, capture_output=True, timeout=180)
        cluster = _of_cluster(temp)
        daemons = [p for p in cluster if _cmdline(p).split()[0].endswith(("gcs_server", "raylet"))]
        assert len(daemons) == 2, [_cmdline(p)[:80] for p in cluster]
        proc = subprocess.Popen([sys.executable, "-m", "megatrain_ray.cli", "train", "--set",
                                 f"cluster.ray_address=127.0.0.1:{port}", "--set", "train.steps=100000", "--set",
                                 f"memory.shm_dir={shm_dir}", "--set", f"train.run_dir={tmp_path / 'runs'}"],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []

        def read():
            for line in proc.stdout:
                lines.append((time.monotonic(), line.rstrip("\n")))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        start = time.monotonic()
        while not any("step     2/" in line for _, line in lines):
            assert proc.poll() is None and time.monotonic() - start < 400, "\n".join(line for _, line in lines)[-3000:]
            time.sleep(0.2)
        cluster = _of_cluster(temp)  # the workers of the run too
        for p in daemons:
            p.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(timeout=180)
        reader.join(timeout=10)
        ours = [(t, line) for t, line in lines if line.startswith("error: Ray's ")]
        assert ours, "\n".join(line for _, line in lines)[-3000:]
        (t, line), = ours
        assert t - killed < 30, t - killed  # seconds, not Ray's 60 s reconnect timeout
        assert "stopped accepting connections (its process died, or its node went away), so the run cannot go on; " \
               "start Ray again (`ray start --head`) and resume the run" in line, line
        assert "the last good checkpoint is " in line or "checkpoint" not in line
        assert os.listdir(shm_dir) == []  # the segments went with the run
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        _stop(cluster + _of_cluster(temp))
        shutil.rmtree(temp, ignore_errors=True)


LOSE_A_NODE = r"""
import json, re, sys
import ray
from ray.cluster_utils import Cluster
from megatrain_ray.config import load_config
from megatrain_ray.orchestration.pipeline import train

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "include_dashboard": False,
                                                       "object_store_memory": 100 * 2**20})
second = cluster.add_node(num_cpus=3, object_store_memory=100 * 2**20)
ray.init(address=cluster.address)  # the lines of Ray's processes forwarded to this terminal, as for a user
lines = []

def log(line):
    print(line, flush=True)  # the run's terminal
    lines.append(line)
    if re.match(r"step\s+3/", line) and "lost" not in lines:
        cluster.remove_node(second, allow_graceful=False)  # the node and every process on it, at once
        lines.append("lost")
        cluster.add_node(num_cpus=3, object_store_memory=100 * 2**20)  # a replacement joins

try:
    result = train(load_config(None, json.loads(sys.argv[1])), log=log)
    print("RESULT " + json.dumps({"lines": lines, "steps": len(result.losses), "restarts": result.restarts,
                                  "run_dir": result.run_dir}))
finally:
    ray.shutdown()
    cluster.shutdown()
"""


@pytest.mark.slow  # two simulated nodes, one of them lost mid-run
def test_a_lost_node_of_two_restarts_the_run_on_its_replacement(shm_dir, tmp_path):
    import json

    overrides = [f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path / 'runs'}", "compute.device=cpu",
                 "parallel.nodes=2", "cluster.ray_address=local", "train.steps=8", "train.seq_len=32",
                 "train.micro_batch_size=2", "train.checkpoint_every=2", "cluster.max_restarts=1",
                 "cluster.actor_timeout_s=300"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", LOSE_A_NODE, json.dumps(overrides)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stdout[-3000:]
    (result,) = [json.loads(line[len("RESULT "):]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    (restart,) = [line for line in result["lines"] if line.startswith("restart ")]
    assert re.match(r"restart 1 of 1: the \S+@1 actor died \(", restart), restart
    assert result["restarts"] == 1 and result["steps"] == 8
    # The terminal: the run's lines, one sentence for the loss (the restart), none of Ray's or gloo's
    # accounts of it; those are in the run's log file.
    terminal = [line for line in out.stdout.splitlines() if not line.startswith("RESULT ")]
    first = next(i for i, line in enumerate(terminal) if line in result["lines"])  # after the script's ray.init
    ours = [line for line in terminal[first:] if line in result["lines"]]
    others = [line for line in terminal[first:] if line not in result["lines"]]
    assert not others, "\n".join(others)[-3000:]
    # (a "warning:" line of ours may follow it: the steps the restart kept whose stats were lost)
    assert [line for line in ours if " died (" in line or line.startswith(("restart", "error"))] == [restart]
    log = open(os.path.join(result["run_dir"], "train.log")).read()
    assert "(pid=raylet)" in log, log[-3000:]
    assert os.listdir(shm_dir) == []
