"""The driver killed: its roles write no checkpoint it did not ask for, and a resume reads
metrics.jsonl past a row cut short and names the steps whose rows were lost, never leaving them out
silently."""

import json
import os
import shutil
import socket
import subprocess
import sys
import uuid

import pytest

from megatrain_ray.config import load_config
from megatrain_ray.engine.store.host_store import ParameterStore
from megatrain_ray.errors import CheckpointError, ConfigError
from megatrain_ray.io.checkpoint import CheckpointSettings, step_dirs
from megatrain_ray.io.writer import CheckpointWriter
from megatrain_ray.orchestration import metrics_file
from megatrain_ray.orchestration.pipeline import _rows_resumed
from megatrain_ray.orchestration.resolve import Facts, resolve
from megatrain_ray.plot import read_metrics


def _rows(path, steps, torn=""):
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in steps) + torn)


def test_a_resume_reads_past_a_last_row_cut_short_and_says_so(tmp_path):
    _rows(tmp_path / "metrics.jsonl", range(1, 7), torn='{"step": 7, "loss": 0.9, "grad_no')
    lines = []
    _rows_resumed(str(tmp_path), 5, lines.append)
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert lines == [f"resume: left out the last line of {tmp_path / 'metrics.jsonl'}, which was cut short (the run "
                     "was stopped while writing it)"]
    # plot reads such a file too
    _rows(tmp_path / "metrics.jsonl", range(1, 4), torn='{"step": 4, "lo')
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3]


def test_a_damaged_row_before_the_last_is_refused_by_its_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"ste\n{"step": 3}\n')
    with pytest.raises(ConfigError, match=r"^line 2 of .*metrics.jsonl is not a metrics row \(JSON with a step\); "):
        _rows_resumed(str(tmp_path), 3, print)


def test_a_resume_names_the_steps_whose_rows_were_lost(tmp_path):
    # The driver was killed at step 8; its roles still trained steps 9 and 10 and saved a checkpoint of
    # step 10 before they went: the resume starts there, rows 9 and 10 were never written.
    _rows(tmp_path / "metrics.jsonl", range(1, 9))
    lines = []
    _rows_resumed(str(tmp_path), 10, lines.append)
    assert lines == ["warning: steps 9-10 have no row in metrics.jsonl: trained and in the checkpoint of step 10, but "
                     "their stats (loss, grad norm, lr) were lost with the process that ran them."]
    lines.clear()
    _rows_resumed(str(tmp_path), 8, lines.append)  # every row there: nothing said
    assert lines == []
    assert metrics_file.step_ranges([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"


def test_a_run_branched_from_a_checkpoint_counts_its_rows_from_that_step(tmp_path):
    ckpt = tmp_path / "older" / "checkpoints" / "step-000004"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 4}))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"resumed_from": str(ckpt)}))
    _rows(run / "metrics.jsonl", [5, 6, 8])
    lines = []
    _rows_resumed(str(run), 8, lines.append)
    assert lines == ["warning: step 7 has no row in metrics.jsonl: trained and in the checkpoint of step 8, but "
                     "their stats (loss, grad norm, lr) were lost with the process that ran them."]


def test_no_checkpoint_is_written_once_the_driver_is_gone(tmp_path, shm_dir):
    """The driver killed with -9: its roles run on for a step or two until Ray ends them, and the sink
    reached a checkpoint boundary meanwhile. Nobody asked for that checkpoint (and no row of its steps
    was written): it is refused, so a resume starts where the driver's record ends."""
    cfg = load_config(None, ["compute.device=cpu", f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path}"])
    driver = subprocess.Popen([sys.executable, "-c", "pass"])
    driver.wait()  # its process is gone
    run = resolve(cfg, Facts("cpu"))
    settings = CheckpointSettings(str(tmp_path / "checkpoints"), 1, 2, cfg.to_dict(), "r", {})
    for owner, host in ((driver.pid, socket.gethostname()), (os.getpid(), socket.gethostname()), (driver.pid, "")):
        store = ParameterStore(run.store_spec(owner, "w-" + uuid.uuid4().hex[:6], host), cfg.train.seed)
        try:
            writer = CheckpointWriter(store.store, settings)
            if owner == driver.pid and host:
                with pytest.raises(CheckpointError) as info:
                    writer.save(0)
                assert str(info.value) == (f"refusing to checkpoint step 0: the run's driver (process {driver.pid}) "
                                           "is gone, so its roles write no checkpoint it did not ask for.")
                assert not (tmp_path / "checkpoints").exists() or step_dirs(str(tmp_path / "checkpoints")) == []
            else:  # the driver alive, or on a machine this one cannot see: written
                assert os.path.isdir(writer.save(0))
                shutil.rmtree(tmp_path / "checkpoints")
        finally:
            store.close()


def test_no_adapter_checkpoint_is_written_once_the_driver_is_gone(tmp_path, shm_dir):
    """A LoRA run's checkpoints are written by its first compute worker from the adapters it holds
    (:meth:`DeviceAdapters.checkpoint`): with the driver killed, that worker refuses too, in the same
    sentence, and leaves no step directory; with the driver alive (or on a machine this one cannot
    see) the adapters' checkpoint is written and reads back as one."""
    import torch

    from megatrain_ray.engine.compute.adapters import DeviceAdapters
    from megatrain_ray.io import lora_checkpoint

    cfg = load_config(None, ["compute.device=cpu", "lora.rank=4", "lora.alpha=8", f"memory.shm_dir={shm_dir}",
                             f"train.run_dir={tmp_path}"])
    driver = subprocess.Popen([sys.executable, "-c", "pass"])
    driver.wait()  # its process is gone
    run = resolve(cfg, Facts("cpu"))
    settings = CheckpointSettings(str(tmp_path / "checkpoints"), 1, 2, cfg.to_dict(), "r", {})
    for owner, host in ((driver.pid, socket.gethostname()), (os.getpid(), socket.gethostname()), (driver.pid, "")):
        store = ParameterStore(run.store_spec(owner, "a-" + uuid.uuid4().hex[:6], host), cfg.train.seed)
        adapters = DeviceAdapters(store.store, cfg.train.seed, torch.device("cpu"), cfg.optim, cfg.train.steps,
                                  checkpoints=settings)
        try:
            if owner == driver.pid and host:
                with pytest.raises(CheckpointError) as info:
                    adapters.checkpoint(0)
                assert str(info.value) == (f"refusing to checkpoint step 0: the run's driver (process {driver.pid}) "
                                           "is gone, so its roles write no checkpoint it did not ask for.")
                assert not (tmp_path / "checkpoints").exists() or step_dirs(str(tmp_path / "checkpoints")) == []
            else:  # the driver alive, or on a machine this one cannot see: written
                notice = adapters.checkpoint(0)
                assert notice["step"] == 0 and notice["by"] == "compute"
                assert lora_checkpoint.load(notice["checkpoint"], cfg.model, cfg.lora)[0] == 0
                shutil.rmtree(tmp_path / "checkpoints")
        finally:
            adapters.close()
            store.close()
