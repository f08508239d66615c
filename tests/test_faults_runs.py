"""Two runs that meet: a run directory is held by the process that trains or resumes it (real
processes, real ``flock``s, the real command line).

- ``train --resume`` of a run another process is training is refused at once, in one sentence that
  names that process's id; the live run goes on and its checkpoints are untouched.
- The hold ends with its process, ``kill -9`` included: no stale lock is ever left.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from megatrain_ray.errors import CheckpointError
from megatrain_ray.io import checkpoint, run_lock
from megatrain_ray.orchestration.pipeline import train
from test_faults import _cfg

_HOLD = ("import sys, time\nfrom megatrain_ray.io import run_lock\nrun_lock.acquire(sys.argv[1], 'training')\n"
         "print('held', flush=True)\ntime.sleep(600)\n")


def test_a_held_run_directory_is_refused_naming_its_process_and_freed_by_kill_9(tmp_path):
    run = tmp_path / "runs" / "run-1"
    run.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(run)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError) as info:
            run_lock.acquire(str(run), "resuming")
        assert str(info.value) == (f"the run directory {run} is in use by process {holder.pid}, which trains or "
                                   "resumes that run; wait for it to end (or stop it: Ctrl-C saves a checkpoint) "
                                   "before resuming it.")
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        fd = run_lock.acquire(str(run), "resuming")  # the lock went with the process
        run_lock.release(fd)
        assert os.listdir(run) == []  # nothing written into the run directory
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert run_lock.run_of(str(run / "checkpoints" / "step-000002")) == str(run)


@pytest.mark.slow  # trains a run and, meanwhile, tries to resume it from another process
def test_resuming_a_run_that_another_process_trains_is_refused(ray_cluster, shm_dir, tmp_path):
    seen = {}

    def log(line):
        if line.startswith("checkpoint: step 2 saved") and "proc" not in seen:
            ckpt = line.split(" saved to ")[1].split(" in ")[0]
            started = time.monotonic()
            seen["proc"] = subprocess.run(
                [sys.executable, "-m", "megatrain_ray.cli", "train", "--resume", ckpt,
                 "--set", f"memory.shm_dir={shm_dir}"], capture_output=True, text=True, timeout=300,
                env={**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "PYTHONPATH": os.getcwd(),
                     "RAY_ADDRESS": "127.0.0.1:1"})  # no Ray may be reached for the refusal
            seen["s"], seen["ckpt"] = time.monotonic() - started, ckpt

    result = train(_cfg(shm_dir, tmp_path, "train.steps=6", "train.checkpoint_every=2"), log=log)
    proc = seen["proc"]
    run_dir = os.path.dirname(os.path.dirname(seen["ckpt"]))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: the run directory {run_dir} is in use by process {os.getpid()}, which trains or resumes that "
        "run; wait for it to end (or stop it: Ctrl-C saves a checkpoint) before resuming it.")
    assert "Traceback" not in proc.stderr
    assert result.run_dir == run_dir and len(result.losses) == 6  # the live run went on
    checkpoint.check_files(checkpoint.latest(os.path.join(run_dir, "checkpoints")))
    assert os.listdir(shm_dir) == []
