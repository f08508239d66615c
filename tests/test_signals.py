"""Signals as terminals and schedulers send them end a run with a checkpoint.

- Ctrl-C with stdout and stderr into a pipe whose reader is gone (``train 2>&1 | tee``, tee killed by
  the same Ctrl-C): the interrupt checkpoint is still saved, and the run's log file keeps the lines.
- SIGTERM to the whole process group, sent by a real GNU ``timeout`` (as Slurm, systemd and
  Kubernetes signal a job): the driver still has its Ray (a private Ray runs in a session of its
  own), finishes the steps in flight and saves, within the time it states.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from megatrain_ray.io import checkpoint
from megatrain_ray.orchestration import console


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def _train_args(shm_dir, work_dir) -> list[str]:
    """The run's own private Ray (cluster.ray_address=local): never a cluster that another test, or
    another user of the machine, started with ``ray start --head``."""
    return [sys.executable, "-m", "megatrain_ray.cli", "train", "--set", "cluster.ray_address=local",
            "--set", f"memory.shm_dir={shm_dir}",
            "--set", "train.steps=100000", "--set", "train.checkpoint_every=0",
            "--set", f"train.run_dir={work_dir / 'runs'}"]


def _default_sigint():
    """The child's SIGINT at its default (pytest in the background of a shell passes it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for_step(read_line, step: int, proc, deadline_s: float = 300) -> list[str]:
    """Lines read until the progress line of ``step``."""
    lines, deadline = [], time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        line = read_line()
        if not line:
            pytest.fail(f"the run ended before step {step} ({proc.poll()}): {''.join(lines)[-3000:]}")
        lines.append(line)
        if re.match(rf"step\s+{step}/", line):
            return lines
    pytest.fail(f"no step {step} within {deadline_s} s")


def _one_run_dir(work_dir):
    (run_dir,) = (work_dir / "runs").iterdir()
    return run_dir


def test_ctrl_c_into_a_closed_pipe_still_saves_the_checkpoint(shm_dir, tmp_path):
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(_train_args(shm_dir, tmp_path), cwd=tmp_path, env=_env(), stdout=write_end,
                            stderr=write_end, preexec_fn=_default_sigint)
    os.close(write_end)
    try:
        with os.fdopen(read_end) as pipe:
            _wait_for_step(pipe.readline, 3, proc)
        # The reader is gone (as tee, killed by the same Ctrl-C): every write to the pipe now fails.
        proc.send_signal(signal.SIGINT)
        status = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert status == 130
    run_dir = _one_run_dir(tmp_path)
    log = (run_dir / console.LOG_FILE).read_text()
    saved = checkpoint.latest(str(run_dir / "checkpoints"), missing_ok=True)
    assert saved is not None, log[-3000:]
    step = checkpoint.read_meta(saved)["step"]
    assert step >= 3
    assert "interrupted: finishing the steps up to" in log
    assert f"checkpoint: step {step} saved to {saved}" in log
    assert "BrokenPipeError" not in log and "Traceback" not in log
    # Every step the checkpoint holds has its metrics row.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, step + 1))
    assert os.listdir(shm_dir) == []


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs GNU coreutils' timeout")
def test_sigterm_to_the_process_group_by_timeout_ends_with_a_checkpoint(shm_dir, tmp_path):
    # GNU timeout runs its command in its own process group; on expiry, or when it is itself
    # signalled (as here, once the run is training: no wait on timing this test does not control),
    # it sends SIGTERM to the command and then to that whole group, Ray's processes included if
    # they were in it.
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(["timeout", "-s", "TERM", "900", *_train_args(shm_dir, tmp_path)], cwd=tmp_path,
                                env=_env(), stdout=subprocess.PIPE, stderr=err, text=True, preexec_fn=_default_sigint)
    try:
        lines = _wait_for_step(proc.stdout.readline, 3, proc)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    stderr = err_path.read_text()
    out = "".join(lines) + out
    assert proc.returncode == 130, stderr[-3000:]
    run_dir = _one_run_dir(tmp_path)
    saved = checkpoint.latest(str(run_dir / "checkpoints"), missing_ok=True)
    assert saved is not None, stderr[-3000:]
    assert f"after saving a checkpoint to {saved}" in stderr
    # Its Ray was alive to the end: no wait on a dead GCS (60 s before Ray gives up), and the run
    # ended within what it stated (the steps in flight and one save) plus its teardown.
    assert "Failed to connect to GCS" not in stderr
    (stated,) = re.findall(r"interrupted: finishing the steps up to \d+ and saving a checkpoint "
                           r"\(the steps in about (\d+)s, then the first save\)", out)
    assert took < int(stated) + 45, (took, stated)
    assert os.listdir(shm_dir) == []


def test_a_ctrl_c_during_rays_exit_shutdown_prints_no_traceback(tmp_path):
    """A second Ctrl-C pressed while the ended run's process exits lands in Ray's exit handler
    (``ray.shutdown``, registered when ray is imported). Here that handler is one that sends the
    Ctrl-C itself (to its own process, delivered at once), and the CLI's command has ended: no
    "Exception ignored in atexit callback ... KeyboardInterrupt", exit status as the command's."""
    script = ("import atexit, os, signal, sys\n"
              "import ray\n"
              "def shutdown():  # as Ray's handler is entered by a Ctrl-C\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "    print('shutdown finished', flush=True)\n"
              "atexit.register(shutdown)  # registered where Ray registers its own: before the command runs\n"
              "from megatrain_ray import cli\n"
              "sys.exit(cli.main(['plot', sys.argv[1]]))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                          env={**_env(), "PYTHONPATH": os.getcwd()}, preexec_fn=_default_sigint, timeout=120)
    assert "Exception ignored" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr
    assert proc.stdout == "shutdown finished\n" and proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
