"""No shared-memory segment of a run survives it: success, exception, SIGINT, SIGTERM, dead owners."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
import ray

from megatrain_ray.config import load_config
from megatrain_ray.engine.store import shm
from megatrain_ray.orchestration.pipeline import train

KINDS = {"master", "exp_avg", "exp_avg_sq", "grad", "versions"}  # cpu + float32: no separate stream copy


def _tiny_cfg(shm_dir, run_dir, steps=2):
    return load_config(None, [f"memory.shm_dir={shm_dir}", f"train.run_dir={run_dir}",
                              f"train.steps={steps}", "compute.device=cpu", "cluster.actor_timeout_s=120"])


def _kind(name: str, owner_pid: int, run_id: str) -> str:
    prefix = f"{shm.PREFIX}{owner_pid}-{run_id}-"
    assert name.startswith(prefix), name
    return name[len(prefix):]


def _run_id(name: str) -> str:
    """megatrain-<pid>-<run id>-<kind> -> run id (which itself holds dashes)."""
    return name[len(shm.PREFIX):].rsplit("-", 1)[0].split("-", 1)[1]


def _named_actors_of(run_id: str) -> list[str]:
    return [a["name"] if isinstance(a, dict) else a
            for a in ray.util.list_named_actors(all_namespaces=True)
            if (a["name"] if isinstance(a, dict) else a).endswith(run_id)]


def _live_placement_groups_of(run_id: str) -> list[str]:
    return [pg["name"] for pg in ray.util.placement_group_table().values()
            if pg.get("name", "").startswith(f"megatrain-{run_id}") and pg.get("state") != "REMOVED"]


def test_segments_exist_during_a_run_and_are_removed_after(ray_cluster, shm_dir, tmp_path):
    seen = []

    def log(line):
        seen.append((line, sorted(os.listdir(shm_dir))))

    result = train(_tiny_cfg(shm_dir, tmp_path), log=log)

    step_lines = [(line, names) for line, names in seen if line.startswith("step")]
    assert len(step_lines) == 2
    for _, names in step_lines:
        assert {_kind(n, os.getpid(), result.run_id) for n in names} == KINDS
    assert len(result.losses) == 2
    assert os.listdir(shm_dir) == []


def test_segments_are_removed_when_the_run_raises(ray_cluster, shm_dir, tmp_path):
    class Boom(Exception):
        pass

    seen, during = [], {}

    def log(line):
        if line.startswith("step"):
            seen.append(sorted(os.listdir(shm_dir)))
            run_id = _run_id(seen[0][0])
            during.update(actors=_named_actors_of(run_id), pgs=_live_placement_groups_of(run_id))
            raise Boom("stop here")

    with pytest.raises(Boom, match="stop here"):
        train(_tiny_cfg(shm_dir, tmp_path, steps=5), log=log)

    assert len(seen) == 1
    run_id = _run_id(seen[0][0])
    assert {_kind(n, os.getpid(), run_id) for n in seen[0]} == KINDS
    assert os.listdir(shm_dir) == []
    assert {a.rsplit("-" + run_id, 1)[0] for a in during["actors"]} == {
        "store", "prefetch", "compute", "grad-sink", "data-0", "queues"}  # queues: the node's queue host
    assert during["pgs"] == [f"megatrain-{run_id}-n0"]  # one placement group per node
    # The run's actors and placement group were torn down too (asynchronous in Ray: poll briefly).
    deadline = time.monotonic() + 30
    while (_named_actors_of(run_id) or _live_placement_groups_of(run_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _named_actors_of(run_id) == []
    assert _live_placement_groups_of(run_id) == []


# ---------------------------------------------------------------------------------------------
# Signals: the CLI as a subprocess, stopped once its segments exist.

@pytest.fixture(scope="module")
def signal_dir_factory(shm_dirs):
    with contextlib.ExitStack() as made:  # every directory made is removed after the module
        yield lambda: made.enter_context(shm_dirs())


def _interrupt_cli(sig, shm_dir, work_dir):
    """Start a long CLI run, send ``sig`` once its segments exist; (status, stderr, leftovers, pid)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out_path, err_path = work_dir / "stdout.txt", work_dir / "stderr.txt"
    # A child inherits an *ignored* SIGINT (pytest run in the background of a non-interactive shell),
    # so give it a default disposition: handlers (unlike SIG_IGN) are reset by exec.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with open(out_path, "w") as out, open(err_path, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "megatrain_ray.cli", "train", "--set", f"memory.shm_dir={shm_dir}",
                 "--set", "train.steps=100000", "--set", f"train.run_dir={work_dir / 'runs'}",
                 "--set", "cluster.ray_address=local"],  # its own Ray, never another test's `ray start --head`
                cwd=work_dir, env=env, stdout=out, stderr=err)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        deadline = time.monotonic() + 300  # bounds for a loaded machine: Ray's start alone can take a minute
        while not os.listdir(shm_dir):
            assert proc.poll() is None, f"the run ended early ({proc.returncode}): {err_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "no segment appeared within 300 s"
            time.sleep(0.1)
        during = sorted(os.listdir(shm_dir))
        proc.send_signal(sig)
        status = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert all(n.startswith(f"{shm.PREFIX}{proc.pid}-") for n in during), during
    return status, err_path.read_text(), sorted(os.listdir(shm_dir)), proc.pid


@pytest.fixture(scope="module")
def sigint_run(signal_dir_factory, tmp_path_factory):
    return _interrupt_cli(signal.SIGINT, signal_dir_factory(), tmp_path_factory.mktemp("sigint"))


@pytest.fixture(scope="module")
def sigterm_run(signal_dir_factory, tmp_path_factory):
    return _interrupt_cli(signal.SIGTERM, signal_dir_factory(), tmp_path_factory.mktemp("sigterm"))


def test_sigint_exits_130_and_removes_segments(sigint_run):
    status, stderr, leftovers, _ = sigint_run
    assert status == 130, stderr[-3000:]
    assert leftovers == []
    assert "interrupted:" in stderr
    assert "Traceback" not in stderr


def test_sigterm_exits_nonzero_and_removes_segments(sigterm_run):
    status, stderr, leftovers, _ = sigterm_run
    assert status != 0, stderr[-3000:]
    assert leftovers == []


def test_sigterm_exits_like_ctrl_c(sigterm_run):
    status, stderr, _, _ = sigterm_run
    assert status == 130, status
    assert "interrupted:" in stderr


# ---------------------------------------------------------------------------------------------
# Stale segments of dead runs.

def _dead_pid() -> int:
    for _ in range(20):
        proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
        pid = int(proc.stdout)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
    pytest.fail("could not find a dead pid")


def test_remove_stale_removes_dead_owners_only(shm_dir):
    dead = _dead_pid()
    alive = os.getpid()
    stale = [shm.segment_path(shm_dir, dead, "20250101-000000-abcdef", k) for k in ("master", "versions")]
    live = shm.segment_path(shm_dir, alive, "20250101-000000-123456", "master")
    other = os.path.join(shm_dir, "not-ours")
    for path in [*stale, live, other]:
        with open(path, "wb") as f:
            f.write(b"\0" * 64)

    removed = shm.remove_stale(shm_dir)

    assert sorted(removed) == sorted(stale)
    assert sorted(os.listdir(shm_dir)) == sorted([os.path.basename(live), "not-ours"])
    # Idempotent: nothing more to remove.
    assert shm.remove_stale(shm_dir) == []


def test_train_removes_stale_segments_before_starting(ray_cluster, shm_dir, tmp_path):
    dead = _dead_pid()
    stale = shm.segment_path(shm_dir, dead, "20250101-000000-abcdef", "master")
    with open(stale, "wb") as f:
        f.write(b"\0" * 64)
    lines = []
    train(_tiny_cfg(shm_dir, tmp_path, steps=1), log=lines.append)
    assert any("stale" in line and stale in line for line in lines), lines
    assert os.listdir(shm_dir) == []
