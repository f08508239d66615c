"""Shared fixtures: one real local Ray cluster for the whole test session, private shm directories;
and the log callbacks that interrupt a run or kill its actors in turn."""

import contextlib
import os
import re
import subprocess
import threading
import time

import pytest
import ray


def _ours(thread: threading.Thread) -> bool:
    """Whether a thread runs code of this project (the package or a test), not a library's own."""
    target = getattr(thread, "_target", None)
    module = getattr(target, "__module__", None) or getattr(getattr(target, "__func__", None), "__module__", "") or ""
    return module.startswith(("megatrain_ray", "test_", "tests.", "conftest"))


@pytest.fixture(autouse=True)
def no_thread_left_behind():
    """Every test stops the threads it started: one of the project's still running 10 s after the
    test ended fails it (left running, it would fail another test later, or hold a store)."""
    before = set(threading.enumerate())
    yield
    left = [t for t in threading.enumerate() if t not in before and _ours(t)]
    deadline = time.monotonic() + 10
    for thread in left:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [f"{t.name} ({getattr(t._target, '__qualname__', t._target)})" for t in left if t.is_alive()]
    if alive:
        pytest.fail(f"the test left threads running: {', '.join(alive)}")


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray (8 logical CPUs, the GPUs this machine has, no dashboard), shared by every
    test that needs it; started within a bound that fits a busy machine (tests/ray_start.py)."""
    import torch

    from ray_start import start

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not ray.is_initialized():
        start(lambda: ray.init(address="local", num_cpus=8, num_gpus=torch.cuda.device_count(),
                               include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False))
    yield
    ray.shutdown()


@contextlib.contextmanager
def _private_shm_dir(fallback: str):
    """A private directory standing in for /dev/shm (under ``fallback`` where there is none), so a
    test can list exactly what a run left; removed with its files afterwards."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else fallback
    path = os.path.join(base, f"megatrain-test-{os.getpid()}-{os.urandom(4).hex()}")
    os.makedirs(path)
    try:
        yield path
    finally:
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))
        os.rmdir(path)


@pytest.fixture(scope="session")
def shm_dirs(tmp_path_factory):
    """``with shm_dirs() as path:`` a private shm directory, for fixtures wider than one test."""
    return lambda: _private_shm_dir(str(tmp_path_factory.getbasetemp()))


@pytest.fixture
def shm_dir(shm_dirs):
    """A private shm directory for one test (see :func:`_private_shm_dir`)."""
    with shm_dirs() as path:
        yield path


def _mounted(args: list[str], path, what: str):
    """Mount ``args`` onto ``path`` (needs root), yield it, unmount; skip where mounting is not permitted."""
    proc = subprocess.run(["mount", *args, str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot {what} here: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    """A real 2 MiB tmpfs (needs root); skipped where mounting is not permitted."""
    (tmp_path / "disk").mkdir()
    yield from _mounted(["-t", "tmpfs", "-o", "size=2m", "tmpfs"], tmp_path / "disk", "mount a small tmpfs")


@pytest.fixture
def read_only_dir(tmp_path):
    """A real read-only directory: a read-only bind mount of tmp_path/ro (root can write anywhere else)."""
    (tmp_path / "ro").mkdir()
    yield from _mounted(["--bind", "-o", "ro", str(tmp_path / "ro")], tmp_path / "ro", "bind-mount read-only")


def interrupt_after_checkpoint(step: int, lines: list[str]):
    """A log callback that records lines and raises KeyboardInterrupt (as Ctrl-C) once the checkpoint
    of ``step`` is reported saved."""
    def log(line):
        lines.append(line)
        if line.startswith(f"checkpoint: step {step} saved"):
            raise KeyboardInterrupt

    return log


def kill_in_turn(roles: list[str], lines: list[str]):
    """A log callback that records lines and ray.kill s each role's actor in turn: the first at the
    step-2 line, each next one at the first step line after the pipeline restarted from the previous."""
    pending = list(roles)

    def log(line):
        lines.append(line)
        restarts = sum(ln.startswith("restart ") for ln in lines)
        killed = sum(ln.startswith("killed ") for ln in lines)
        m = re.match(r"step\s+(\d+)/", line)
        if m and pending and restarts == killed and int(m.group(1)) >= 2:
            role = pending.pop(0)
            suffix = re.compile(rf"-r{restarts}$" if restarts else r"-[0-9a-f]{6}$")
            (actor,) = [a for a in ray.util.list_named_actors(all_namespaces=True)
                        if a["name"].startswith(role + "-") and suffix.search(a["name"])]
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            lines.append(f"killed {actor['name']}")

    return log
