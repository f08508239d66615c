"""The README's Ray-job flow beside another Ray on the machine: ``jobs/head.py start`` (free ports, its
own temp dir), ``ray job submit --address`` to the address it printed, ``jobs/head.py stop``.

The other Ray: this test session's own local Ray (the ``ray_cluster`` fixture), and Ray's default
ports of a head (GCS 6379, dashboard 8265, its agent 52365, Ray client 10001) held by sockets here
where they were free, as another user's ``ray start --head`` would hold them (the agent's port taken
made ``ray job submit`` fail with "No available agent to submit job"). The job succeeds on the head
the flow started, and the stop stops that head alone: the session's Ray still runs tasks.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

from processes import finish

pytestmark = pytest.mark.slow  # a Ray head started and a job submitted through the CLI: minutes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PORTS = (6379, 8265, 52365, 10001)


def _hold(ports):
    """Listening sockets on those of ``ports`` that are free (the others are someone's already)."""
    held = []
    for port in ports:
        s = socket.socket()
        try:
            s.bind(("0.0.0.0", port))
            s.listen()
            held.append(s)
        except OSError:
            s.close()
    return held


def _run(args, env, cwd, timeout=600):
    proc = subprocess.Popen(args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = finish(proc, timeout)
    return proc.returncode, out, err


def test_the_readme_job_flow_beside_another_ray(ray_cluster, tmp_path, shm_dir):
    import ray

    if shutil.which("ray") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "ray")):
        pytest.skip("the ray CLI is not on PATH")
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "ADDRESS=$(python jobs/head.py start)" in readme and "python jobs/head.py stop" in readme
    assert not re.search(r"^ray stop", readme, re.M)  # never the stop of every Ray

    home = tempfile.mkdtemp(prefix="mtr-home-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(HOME=home, RAY_AUTH_MODE="token", RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    held = _hold(DEFAULT_PORTS)
    work = tmp_path / "here"  # where the user runs the flow: head.py keeps its record there
    work.mkdir()
    head = [sys.executable, os.path.join(ROOT, "jobs", "head.py")]
    try:
        rc, _, err = _run(["ray", "get-auth-token", "--generate"], env, work)
        assert rc == 0, err[-2000:]
        rc, address, err = _run([*head, "start", "--num-cpus=4"], env, work)
        assert rc == 0, err[-3000:]
        address = address.strip()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", address) and int(address.rsplit(":", 1)[1]) not in DEFAULT_PORTS
        temp = json.loads((work / ".ray-head.json").read_text())["temp_dir"]
        rc, again, _ = _run([*head, "address"], env, work)
        assert rc == 0 and again.strip() == address
        rc, out, err = _run(["ray", "job", "submit", "--address", address, "--working-dir", ROOT, "--", "python",
                             "jobs/train.py", "--config", "configs/tiny.yaml", "--set", "train.steps=3",
                             "--set", "compute.device=cpu", "--set", f"memory.shm_dir={shm_dir}",
                             "--set", f"train.run_dir={tmp_path / 'runs'}"], env, work, timeout=900)
        logs = out + err
        assert rc == 0, logs[-4000:]
        assert re.search(r"step\s+3/3 \| loss", logs), logs[-4000:]
        assert "No available agent" not in logs
    finally:
        rc, _, err = _run([*head, "stop"], env, work)
        for s in held:
            s.close()
        shutil.rmtree(home, ignore_errors=True)
    assert rc == 0, err
    assert not (work / ".ray-head.json").exists()
    assert not [p for p in os.listdir("/proc") if p.isdigit() and temp in _cmdline(p)]  # none of its processes
    # The other Ray still runs: the stop stopped this head alone.
    assert ray.is_initialized() and ray.get(ray.put(41)) == 41
    assert ray.get(ray.remote(lambda: 42).remote(), timeout=120) == 42
    assert os.listdir(shm_dir) == []


def _cmdline(pid: str) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
    except OSError:
        return ""
