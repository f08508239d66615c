"""Every role's death is told under its own name, and every role can be restarted: real ``kill -9``
of the role's process in a running pipeline (the real local Ray of tests/conftest.py).

- With cluster.max_restarts 0 the run ends with one sentence naming the role that died — a data
  loader (whose batch a compute worker was waiting for), the queue host (which every role calls) —
  not the role that noticed first; nothing is left in shared memory.
- The queue host killed with cluster.max_restarts 2 is restarted like any other role, and the run
  finishes with every step reported once.
"""

import json
import os
import re
import signal

import pytest

from megatrain_ray.errors import ActorDied
from megatrain_ray.orchestration.pipeline import train
from test_faults import _cfg, _role_pid, _signal_at_step


@pytest.mark.slow  # kills a role of a running pipeline
@pytest.mark.parametrize("cls,role", [("BatchSource", "data-0"), ("QueueHost", "queues")])
def test_a_dead_role_is_named_as_itself(cls, role, ray_cluster, shm_dir, tmp_path):
    lines, events = [], {}
    with pytest.raises(ActorDied) as info:
        train(_cfg(shm_dir, tmp_path, "train.steps=100000", "cluster.max_restarts=0"),
              log=_signal_at_step(2, cls, signal.SIGKILL, lines, events))
    message = str(info.value)
    assert message.startswith(f"the {role} actor died (its process was killed by a signal or crashed"), message
    assert "\n" not in message and "Traceback" not in message
    assert os.listdir(shm_dir) == []


@pytest.mark.slow  # kills the queue host of a running pipeline, which restarts
def test_the_queue_host_killed_is_restarted(ray_cluster, shm_dir, tmp_path):
    lines, events = [], {}
    steps = 12
    result = train(_cfg(shm_dir, tmp_path, f"train.steps={steps}", "train.checkpoint_every=2",
                        "cluster.max_restarts=2"), log=_signal_at_step(3, "QueueHost", signal.SIGKILL, lines, events))
    text = [line for _, line in lines]
    (restart,) = [line for line in text if line.startswith("restart ")]
    assert restart.startswith("restart 1 of 2: the queues actor died (its process was killed"), restart
    assert result.restarts == 1 and any(line.startswith(f"done: {steps} steps (after 1 restart") for line in text)
    rows = [json.loads(line) for line in open(os.path.join(result.run_dir, "metrics.jsonl"))]
    steps_logged = [r["step"] for r in rows]
    assert steps_logged == sorted(set(steps_logged)) and steps_logged[-1] == steps  # each step once
    assert os.listdir(shm_dir) == []


def _kill_at(prefix: str, cls: str, lines: list):
    """A log callback: SIGKILL the ``cls`` actor at the first line starting with ``prefix``."""
    def log(line):
        lines.append(line)
        if line.startswith(prefix) and "killed" not in lines:
            os.kill(_started(cls), signal.SIGKILL)
            lines.append("killed")
    return log


def _started(cls: str, within: float = 120.0) -> int:
    """The process of the ``cls`` actor once it runs as that actor (an actor spawned a moment ago may
    still be a starting worker process)."""
    import time

    deadline = time.monotonic() + within
    while True:
        try:
            return _role_pid(cls)
        except AssertionError:
            assert time.monotonic() < deadline, f"no {cls} actor within {within} s"
            time.sleep(0.1)


@pytest.mark.slow  # kills roles of a pipeline that is starting
@pytest.mark.parametrize("cls,role", [("BatchSource", "data-0"), ("QueueHost", "queues"),
                                      ("ParameterStore", "store")])
def test_a_role_killed_during_start_up_is_restarted(cls, role, ray_cluster, shm_dir, tmp_path):
    lines = []
    result = train(_cfg(shm_dir, tmp_path, "train.steps=4", "cluster.max_restarts=1"),
                   log=_kill_at("activations (memory.activations=", cls, lines))
    (restart,) = [line for line in lines if line.startswith("restart ")]
    assert restart.startswith(f"restart 1 of 1: the {role} actor died ("), restart
    assert "restarting the pipeline from the initial weights (step 0)" in restart
    assert result.restarts == 1 and len(result.losses) == 4
    assert os.listdir(shm_dir) == []


@pytest.mark.slow  # kills the store as the run ends
def test_the_store_killed_before_the_final_export_restarts_and_exports(ray_cluster, shm_dir, tmp_path):
    import torch
    from safetensors.torch import load_file

    from megatrain_ray.io import checkpoint

    lines = []
    result = train(_cfg(shm_dir, tmp_path, "train.steps=8", "train.checkpoint_every=4", "cluster.max_restarts=1"),
                   log=_kill_at("step     8/8", "ParameterStore", lines))
    (restart,) = [line for line in lines if line.startswith("restart ")]
    assert restart.startswith("restart 1 of 1: the store actor died ("), restart
    last = checkpoint.latest(os.path.join(result.run_dir, "checkpoints"))
    assert last.endswith("step-000008")
    final = load_file(os.path.join(result.final_dir, "model.safetensors")) if os.path.isfile(
        os.path.join(result.final_dir, "model.safetensors")) else None
    saved = {}
    for name in sorted(os.listdir(last)):
        if name.startswith("model") and name.endswith(".safetensors"):
            saved.update(load_file(os.path.join(last, name)))
    exported = final or {k: v for name in sorted(os.listdir(result.final_dir)) if name.endswith(".safetensors")
                         for k, v in load_file(os.path.join(result.final_dir, name)).items()}
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[k].float(), saved[k].float()) for k in saved)  # the weights of step 8
    assert os.listdir(shm_dir) == []


def test_an_interrupt_while_the_final_weights_are_written_names_the_final_checkpoint(ray_cluster, shm_dir, tmp_path):
    """Ctrl-C (or SIGTERM) after the last step, while the run writes its final weights (here: as the
    final checkpoint is reported, just before the export): every step is trained and in that
    checkpoint, and the interrupt says so and where it is (the command then prints how to export it);
    no half-written final directory, nothing left in shared memory."""
    from conftest import interrupt_after_checkpoint
    from megatrain_ray.errors import Interrupted
    from megatrain_ray.io import checkpoint

    lines = []
    with pytest.raises(Interrupted) as info:
        train(_cfg(shm_dir, tmp_path, "train.steps=3", "train.checkpoint_every=0"),
              log=interrupt_after_checkpoint(3, lines))
    assert any(line.startswith("step     3/3") for line in lines), lines
    saved = info.value.checkpoint
    assert saved is not None and checkpoint.read_meta(saved)["step"] == 3, (saved, lines[-5:])
    checkpoint.check_files(saved)
    run_dir = os.path.dirname(os.path.dirname(saved))
    assert not [n for n in os.listdir(run_dir) if n.startswith("final")]  # neither final/ nor its temporary
    assert "export its weights" in checkpoint.advice(saved)
    assert os.listdir(shm_dir) == []


@pytest.mark.slow  # a private Ray in a subprocess, its queue host killed with -9
def test_the_queue_host_killed_without_restarts_leaves_the_terminal_its_sentence_alone(shm_dir, tmp_path):
    """``megatrain-ray train`` as a user runs it, cluster.max_restarts 0; once it steps, ``kill -9`` of
    its queue host: the command ends with status 2, its last line the run's one sentence naming the
    queues actor, and nothing of Ray's after it (no "Unhandled error", no traceback, on stdout or
    stderr); what Ray reported of the calls the death failed is in the run's train.log."""
    import subprocess
    import sys
    import time

    import psutil

    from processes import finish
    from test_faults import _cmdline

    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    proc = subprocess.Popen([sys.executable, "-m", "megatrain_ray.cli", "train", "--set", "cluster.ray_address=local",
                             "--set", "compute.device=cpu", "--set", "train.steps=100000", "--set",
                             "cluster.max_restarts=0", "--set", f"memory.shm_dir={shm_dir}", "--set",
                             f"train.run_dir={tmp_path / 'runs'}"],
                            cwd=tmp_path, env=env, stdout=open(tmp_path / "stdout.txt", "w"),
                            stderr=open(tmp_path / "stderr.txt", "w"))
    try:
        deadline = time.monotonic() + 400
        while "step     2/" not in (tmp_path / "stdout.txt").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stdout.txt").read_text()[-3000:]
            time.sleep(0.2)
        (host,) = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if _cmdline(p).startswith("ray::QueueHost")]
        host.send_signal(signal.SIGKILL)
        finish(proc, 300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out, err = (tmp_path / "stdout.txt").read_text(), (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 2, (out + err)[-3000:]
    said = [line for line in err.splitlines() if line.strip()]
    assert said and said[-1].startswith("error: the queues actor died (its process was killed by a signal or "
                                        "crashed"), err[-3000:]
    after = err[err.index("error: the queues actor died"):]
    assert "\n" not in after.strip(), after[-3000:]  # the sentence is the last thing on the terminal
    for text in (out, err):
        assert "Unhandled error" not in text and "Traceback" not in text and "RayActorError" not in text, text[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    log = (run_dir / "train.log").read_text()
    assert re.search(r"step\s+2/100000", log) and "\x1b" not in log, log[-3000:]
    # Ray reports the failed calls nobody read as their references are freed: during the run, or as
    # the process exits (then appended to the ended run's file), or not before the exit at all.
    reports = log.split("Unhandled error")[1:]
    assert all("(pid=" in r for r in reports), log[-3000:]  # each whole, as Ray wrote it
    assert os.listdir(shm_dir) == []
