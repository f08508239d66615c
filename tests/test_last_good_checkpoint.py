"""Failures in the middle of a run (a diverging loss, a full disk while checkpointing or exporting)
train through the real pipeline and end with one sentence that names the last good checkpoint,
which is intact.
"""

import os

import pytest
import torch

from megatrain_ray import cli
from megatrain_ray.io import checkpoint
from refusals import refused

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("setting", ["memory.resident=none", "memory.resident=embed_head", "optim.placement=device"])
def test_diverging_loss_stops_and_keeps_the_last_good_checkpoint(setting, ray_cluster, shm_dir, tmp_path, capsys,
                                                                 monkeypatch):
    """embed_head: the compute worker updates its units too; optim.placement device: all of them."""
    # lr 1e30: step 1 is finite, its update blows the weights up, step 2's loss is not finite.
    line = refused(["train", "--set", f"memory.shm_dir={shm_dir}", "--set", "compute.device=cpu",
                 "--set", "optim.lr=1e30", "--set", "train.steps=6", "--set", "train.checkpoint_every=1",
                 "--set", "cluster.actor_timeout_s=120", "--set", setting],
                tmp_path, capsys, monkeypatch)
    runs = os.listdir(tmp_path / "runs")
    ckpts = tmp_path / "runs" / runs[0] / "checkpoints"
    assert os.listdir(ckpts) == ["step-000001"]  # nothing of the diverged step, no temporary
    good = ckpts / "step-000001"
    # The driver (non-finite loss) or the sink (non-finite gradient norm) notices first; either says so.
    assert "step 2 is nan" in line and "diverged" in line and "lower optim.lr" in line
    assert f"the last good checkpoint is {good}" in line
    meta = checkpoint.read_meta(str(good))
    assert meta["step"] == 1 and set(meta["versions"].values()) == {1}
    from safetensors.torch import load_file

    tensors = {}
    for name in os.listdir(good):
        if name.endswith(".safetensors"):
            tensors.update(load_file(good / name))
    assert tensors and all(bool(torch.isfinite(t).all()) for t in tensors.values())
    assert os.listdir(shm_dir) == []


def test_disk_full_while_checkpointing_keeps_the_last_good_checkpoint(ray_cluster, shm_dir, small_disk, tmp_path,
                                                                      capsys, monkeypatch):
    line = refused(["train", "--set", f"memory.shm_dir={shm_dir}", "--set", f"train.run_dir={small_disk}",
                 "--set", "compute.device=cpu", "--set", "train.steps=6", "--set", "train.checkpoint_every=1",
                 "--set", "cluster.actor_timeout_s=120"], tmp_path, capsys, monkeypatch)
    (run,) = os.listdir(small_disk)
    ckpts = small_disk / run / "checkpoints"
    good = ckpts / "step-000001"
    assert "could not write the checkpoint of step 2" in line and "No space left on device" in line
    assert f"the last good checkpoint, {good}, is intact" in line
    assert os.listdir(ckpts) == ["step-000001"]  # the failed save left no temporary behind
    checkpoint.check_files(str(good))
    assert checkpoint.read_meta(str(good))["step"] == 1
    assert os.listdir(shm_dir) == []


def test_disk_full_during_the_final_export_keeps_the_weights_in_a_checkpoint(ray_cluster, shm_dir, small_disk,
                                                                               tmp_path, capsys, monkeypatch):
    """train.checkpoint_every=0 on a 2 MiB disk: the final checkpoint (1.6 MB) fits, the export after
    it does not. The error names final/ and the space; no partial final/ is left; the checkpoint is
    whole and the advice (export it, not --resume it: it is the end of the run) works as written."""
    line = refused(["train", "--set", f"memory.shm_dir={shm_dir}", "--set", f"train.run_dir={small_disk}",
                 "--set", "compute.device=cpu", "--set", "train.steps=3", "--set", "train.checkpoint_every=0",
                 "--set", "cluster.actor_timeout_s=120"], tmp_path, capsys, monkeypatch)
    (run,) = os.listdir(small_disk)
    final, end = small_disk / run / "final", small_disk / run / "checkpoints" / "step-000003"
    assert line.startswith(f"error: could not write the final weights to {final} (No space left on device); "
                           "they need "), line
    assert "nothing was left behind" in line and f"the last good checkpoint is {end}" in line
    assert f"export its weights with `megatrain-ray export {end} --out DIR`" in line
    assert "--resume" not in line.split("export its weights")[0]  # no advice to resume a finished run
    assert sorted(os.listdir(small_disk / run)) == ["checkpoints", "config.json", "metrics.jsonl", "train.log"]
    checkpoint.check_files(str(end))
    assert os.listdir(shm_dir) == []
    capsys.readouterr()
    assert cli.main(["export", str(end), "--out", str(tmp_path / "exported")]) == 0
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported") is not None
