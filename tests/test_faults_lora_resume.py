"""A LoRA checkpoint resumed with other lora.* settings (or none) is refused when the resume is read:
one sentence, before the data is read or Ray is connected to."""

import os
import re

import pytest
import torch

from megatrain_ray.config import load_config
from megatrain_ray.errors import ConfigError
from megatrain_ray.io import lora_checkpoint
from megatrain_ray.io.checkpoint import CheckpointSettings
from megatrain_ray.model.lora import AdapterLayout
from megatrain_ray.orchestration import pipeline
from megatrain_ray.orchestration.pipeline import train

BASE = ["train.steps=4", "compute.device=cpu", "lora.rank=4", "lora.alpha=8"]


def _lora_checkpoint(tmp_path) -> str:
    """A LoRA run's checkpoint of step 2 (its adapters' states zero: only its meta.json matters here)."""
    cfg = load_config(None, [*BASE, f"train.run_dir={tmp_path / 'runs'}"])
    layout = AdapterLayout.build(cfg.model, cfg.lora)
    states = {unit: {kind: torch.zeros(t.numel) for kind in lora_checkpoint.STATE_KINDS} for unit, t in layout.trained}
    settings = CheckpointSettings(str(tmp_path / "runs" / "r" / "checkpoints"), 2, 2, cfg.to_dict(), "r", {})
    return lora_checkpoint.save(settings, 2, cfg.model, cfg.lora, states)


@pytest.mark.parametrize("change,says", [
    ("lora.rank=8", "holds other adapters than the run's lora section (rank 4 vs 8); resume without changing lora.*."),
    ("lora.alpha=16", "holds other adapters than the run's lora section (alpha 8.0 vs 16.0); resume without changing "
     "lora.*."),
    ("lora.target_modules=[q_proj]", "holds other adapters than the run's lora section (target_modules "),
    ("lora.rank=0", "holds LoRA adapters (lora.rank 4), not a full model, and the run has lora.rank 0; resume it "
     "without changing lora.*, or export it"),
])
def test_a_lora_resume_with_other_adapters_is_refused_before_any_work(change, says, tmp_path, shm_dir, monkeypatch):
    ckpt = _lora_checkpoint(tmp_path)
    cfg = load_config(None, [*BASE, change, f"train.run_dir={tmp_path / 'runs'}", f"memory.shm_dir={shm_dir}"])

    def work(*args, **kwargs):
        raise AssertionError("the run read its data or connected to Ray before refusing the resume")

    monkeypatch.setattr(pipeline, "run_data", work)
    monkeypatch.setattr(pipeline.cluster, "connect", work)
    before = _tree(tmp_path)
    with pytest.raises(ConfigError) as info:
        train(cfg, log=lambda line: None, resume=ckpt)
    message = str(info.value)
    assert message.startswith(f"checkpoint {ckpt} ") and says in message and "\n" not in message, message
    assert not re.search(r"embed_tokens|lacks the tensor", message)
    assert _tree(tmp_path) == before  # no run directory (nor file) of the refused run left behind


def _tree(root) -> dict[str, int]:
    """Every directory and file under ``root``: its path -> its size (-1 for a directory)."""
    return {os.path.join(d, n): (-1 if n in dirs else os.path.getsize(os.path.join(d, n)))
            for d, dirs, files in os.walk(root) for n in (*dirs, *files)}


def test_the_command_refusing_a_lora_resume_with_another_rank_leaves_no_run_directory(tmp_path, monkeypatch, capsys):
    """``megatrain-ray train --resume CKPT --set lora.rank=8`` as a user runs it: status 2, one error
    line, and nothing new on disk: neither a run directory of its own nor a file in the run resumed."""
    from megatrain_ray import cli

    ckpt = _lora_checkpoint(tmp_path)

    def work(*args, **kwargs):
        raise AssertionError("the run read its data or connected to Ray before refusing the resume")

    monkeypatch.setattr(pipeline, "run_data", work)
    monkeypatch.setattr(pipeline.cluster, "connect", work)
    monkeypatch.chdir(tmp_path)
    before = _tree(tmp_path)
    assert cli.main(["train", "--resume", ckpt, "--set", "lora.rank=8"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"error: checkpoint {ckpt} holds other adapters than the run's lora section (rank 4 "
                                 "vs 8); resume without changing lora.*.\n"), err
    assert _tree(tmp_path) == before
