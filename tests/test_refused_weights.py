"""Weights and checkpoints given to train (train.init_from, --resume), export and eval that do not
hold what they claim: refused by name, and left as they are.

Every case runs ``megatrain-ray`` (``cli.main``, in this process unless it must not share the test
session's Ray) in a scratch working directory and checks: exit status 2, exactly one ``error:`` line
naming what to fix, no traceback, and nothing lost: no run directory or data cache created, no
shared-memory segment left, a checkpoint given to --resume unchanged (helpers in refusals.py).
"""

import json
import os
import shutil

import pytest
import torch

from megatrain_ray.io import checkpoint
from refusals import copy_run, refused, refused_train, snapshot, hf_dir, run_with_checkpoint  # noqa: F401  (fixtures)

transformers = pytest.importorskip("transformers")


STEP = os.path.join("checkpoints", "step-000002")


def _flip_bit(directory, name: str = "model.embed_tokens.weight") -> str:
    """Flip the top exponent bit of the first float of ``name`` in its model shard (same size); returns the shard."""
    (shard,) = [f for f in os.listdir(directory) if f.startswith("model-") and f.endswith(".safetensors")]
    raw = bytearray((directory / shard).read_bytes())
    n = int.from_bytes(raw[:8], "little")
    raw[8 + n + json.loads(raw[8:8 + n])[name]["data_offsets"][0] + 3] ^= 0x40
    (directory / shard).write_bytes(bytes(raw))
    return shard


def _damaged(run_with_checkpoint, tmp_path, damage) -> tuple:
    """A copy of the run with its checkpoint damaged by ``damage(step dir)``; (run, step dir, snapshot)."""
    run = copy_run(run_with_checkpoint, tmp_path)
    damage(run / STEP)
    return run, run / STEP, snapshot(run)


def _init_from(tmp_path, capsys, monkeypatch, config: str, weights: bytes | None) -> str:
    """The error line of a run initialised from tmp_path/model holding this config.json and weights."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(config)
    if weights is not None:
        (model / "model.safetensors").write_bytes(weights)
    return refused(["train", "--set", f"train.init_from={model}", "--set", "train.seq_len=32"], tmp_path,
                capsys, monkeypatch)


def test_seq_len_above_the_checkpoint_max_positions(hf_dir, tmp_path, capsys, monkeypatch):
    line = refused(["train", "--set", f"train.init_from={hf_dir}", "--set", "train.seq_len=256"], tmp_path,
                capsys, monkeypatch)
    assert "train.seq_len (256) exceeds model.max_position_embeddings (128)" in line
    assert os.listdir(tmp_path) == []


def test_init_from_without_safetensors(hf_dir, tmp_path, capsys, monkeypatch):
    line = _init_from(tmp_path, capsys, monkeypatch, (hf_dir / "config.json").read_text(), None)
    assert "train.init_from" in line and "model.safetensors" in line
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_init_from_with_a_truncated_safetensors(hf_dir, tmp_path, capsys, monkeypatch):
    data = (hf_dir / "model.safetensors").read_bytes()
    line = _init_from(tmp_path, capsys, monkeypatch, (hf_dir / "config.json").read_text(),
                      data[:len(data) // 2])  # an interrupted download
    assert "model.safetensors" in line and "corrupt" in line
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_init_from_with_weights_of_another_model(hf_dir, tmp_path, capsys, monkeypatch):
    other = json.loads((hf_dir / "config.json").read_text())
    other["intermediate_size"] = 96  # this config.json does not describe these weights
    line = _init_from(tmp_path, capsys, monkeypatch, json.dumps(other), (hf_dir / "model.safetensors").read_bytes())
    assert "mlp" in line and "has shape" in line and "(96, 32)" in line
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_init_from_with_one_shard_of_several_cut_short(tmp_path, shm_dir, capsys, monkeypatch):
    import torch

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf", max_shard_size="60KB")
    shards = sorted(n for n in os.listdir(tmp_path / "hf") if n.endswith(".safetensors"))
    assert len(shards) > 1
    (tmp_path / "hf" / shards[1]).write_bytes((tmp_path / "hf" / shards[1]).read_bytes()[:1000])
    line = refused_train(tmp_path, capsys, monkeypatch, shm_dir, f"train.init_from={tmp_path / 'hf'}", "train.seq_len=32")
    assert line.startswith(f"error: train.init_from's {shards[1]} in '{tmp_path / 'hf'}' is missing or corrupt (")
    assert sorted(os.listdir(tmp_path)) == ["hf"] and os.listdir(shm_dir) == []


def test_resume_from_a_missing_path(tmp_path, capsys, monkeypatch):
    line = refused(["train", "--resume", "runs/nope"], tmp_path, capsys, monkeypatch)
    assert "--resume 'runs/nope' is not a directory" in line
    assert os.listdir(tmp_path) == []


def test_resume_from_a_run_without_checkpoints(tmp_path, capsys, monkeypatch):
    (tmp_path / "runs" / "run-0").mkdir(parents=True)
    line = refused(["train", "--resume", "runs/run-0"], tmp_path, capsys, monkeypatch)
    assert "holds no checkpoint" in line
    assert os.listdir(tmp_path / "runs" / "run-0") == []


def test_resume_with_a_checkpoint_of_another_model(run_with_checkpoint, tmp_path, capsys, monkeypatch):
    before = snapshot(run_with_checkpoint)
    line = refused(["train", "--resume", run_with_checkpoint, "--set", "model.hidden_size=32"], tmp_path, capsys,
                monkeypatch)
    assert "holds a different model" in line and "hidden_size 64 vs 32" in line
    assert snapshot(run_with_checkpoint) == before
    assert os.listdir(tmp_path) == []


def test_resume_with_a_truncated_checkpoint(run_with_checkpoint, tmp_path, capsys, monkeypatch):
    run = copy_run(run_with_checkpoint, tmp_path)
    shard = run / "checkpoints" / "step-000002" / "optimizer-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    line = refused(["train", "--resume", run], tmp_path, capsys, monkeypatch)
    assert "optimizer-00001-of-00001.safetensors" in line and "corrupt" in line
    assert sorted(os.listdir(run)) == ["checkpoints"]


def test_resume_with_a_broken_meta_json(run_with_checkpoint, tmp_path, capsys, monkeypatch):
    run = copy_run(run_with_checkpoint, tmp_path)
    (run / "checkpoints" / "step-000002" / "meta.json").write_text("{")
    line = refused(["train", "--resume", run / "checkpoints" / "step-000002"], tmp_path, capsys, monkeypatch)
    assert "meta.json" in line and "step-000002" in line


def test_resume_with_other_data(run_with_checkpoint, tmp_path, capsys, monkeypatch):
    (tmp_path / "other.txt").write_text("Some other text that the run was not trained on.\n" * 50)
    before = snapshot(run_with_checkpoint)
    line = refused(["train", "--resume", run_with_checkpoint, "--set", "data.path=other.txt"], tmp_path, capsys,
                monkeypatch)
    assert line.startswith("error: cannot resume: the checkpoint was trained on other tokens (the text of data.path "
                           "changed since, or another file is named); ")
    assert snapshot(run_with_checkpoint) == before
    assert sorted(os.listdir(tmp_path)) == ["other.txt"]


def test_resume_with_nothing_left_to_train(run_with_checkpoint, tmp_path, capsys, monkeypatch):
    line = refused(["train", "--resume", run_with_checkpoint, "--set", "train.steps=2"], tmp_path, capsys,
                monkeypatch)
    assert "train.steps (2)" in line and "step (2)" in line
    assert os.listdir(tmp_path) == []


def test_resume_of_a_checkpoint_whose_bytes_changed_but_not_its_size(run_with_checkpoint, tmp_path, shm_dir, capsys,
                                                                     monkeypatch):
    shards = []
    run, step, before = _damaged(run_with_checkpoint, tmp_path, lambda d: shards.append(_flip_bit(d)))
    line = refused(["train", "--resume", step, "--set", f"memory.shm_dir={shm_dir}"], tmp_path, capsys, monkeypatch)
    assert line.startswith(f"error: checkpoint {step} is corrupt: {shards[0]} does not match the checksum written "
                           "with it (crc32 ")
    assert line.endswith("although its size does: its bytes changed on disk; use an earlier checkpoint of the run.")
    assert snapshot(run) == before and os.listdir(shm_dir) == []


@pytest.mark.parametrize("damage,named", [
    (lambda d: (d / "meta.json").write_text(""), "its meta.json is not readable JSON"),
    (lambda d: (d / "model-00001-of-00001.safetensors").unlink(), "model-00001-of-00001.safetensors is missing"),
    (lambda d: (d / "meta.json").write_text("[]"), "it is not a megatrain-ray checkpoint"),
    (lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": 3}'),
     "model.safetensors.index.json is 17 bytes but was written with "),
])
def test_resume_of_a_run_whose_only_checkpoint_is_broken_names_it(damage, named, run_with_checkpoint, tmp_path,
                                                                  shm_dir, capsys, monkeypatch):
    run, step, before = _damaged(run_with_checkpoint, tmp_path, damage)
    line = refused(["train", "--resume", run, "--set", f"memory.shm_dir={shm_dir}"], tmp_path, capsys, monkeypatch)
    assert line.startswith(f"error: --resume '{run}' holds no valid checkpoint: {step} is corrupt ({named}")
    assert snapshot(run) == before and sorted(os.listdir(tmp_path)) == ["copied-run"]
    assert os.listdir(shm_dir) == []


def test_resume_of_a_checkpoint_from_a_newer_megatrain_ray(run_with_checkpoint, tmp_path, capsys, monkeypatch):
    def newer(d):
        meta = json.loads((d / "meta.json").read_text())
        (d / "meta.json").write_text(json.dumps({**meta, "format_version": 99}))

    run, step, before = _damaged(run_with_checkpoint, tmp_path, newer)
    line = refused(["train", "--resume", step], tmp_path, capsys, monkeypatch)
    assert line == (f"error: checkpoint {step} cannot be read: it has format version 99, newer than this "
                    f"megatrain-ray reads ({checkpoint.FORMAT_VERSION}); upgrade megatrain-ray.")
    assert snapshot(run) == before


@pytest.mark.parametrize("command", ["export", "eval"])
def test_export_and_eval_refuse_a_checkpoint_whose_bytes_changed(command, run_with_checkpoint, tmp_path, capsys,
                                                                 monkeypatch):
    run, step, before = _damaged(run_with_checkpoint, tmp_path, _flip_bit)
    argv = [command, step] + (["--out", tmp_path / "out"] if command == "export" else [])
    line = refused(argv, tmp_path, capsys, monkeypatch)
    assert line.startswith(f"error: checkpoint {step} is corrupt: model-00001-of-00001.safetensors does not match")
    assert snapshot(run) == before and sorted(os.listdir(tmp_path)) == ["copied-run"]


def test_export_of_a_model_directory_with_a_shard_cut_short(hf_dir, tmp_path, capsys, monkeypatch):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(hf_dir, model)
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[:len(data) - 100])
    line = refused(["export", model, "--out", tmp_path / "out"], tmp_path, capsys, monkeypatch)
    assert line == (f"error: the checkpoint's model.safetensors in '{model}' is missing or corrupt (its header "
                    f"describes {len(data) - 8 - int.from_bytes(data[:8], 'little')} bytes of tensors but the file "
                    f"holds {len(data) - 108 - int.from_bytes(data[:8], 'little')} (cut short)); re-save the model "
                    "(save_pretrained) or export it again.")
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_export_out_on_a_read_only_path(run_with_checkpoint, tmp_path, read_only_dir, capsys, monkeypatch):
    before = snapshot(run_with_checkpoint)
    line = refused(["export", run_with_checkpoint, "--out", read_only_dir / "model"], tmp_path, capsys, monkeypatch)
    assert line == (f"error: --out '{read_only_dir / 'model'}' cannot be written to (a read-only file system); "
                    "choose a writable directory.")
    assert snapshot(run_with_checkpoint) == before and os.listdir(read_only_dir) == []


@pytest.mark.parametrize("make,expected", [
    (lambda p: p.write_text(""), "is a file; choose a new directory"),
    (lambda p: (p.mkdir(), (p / "x").write_text("")), "exists and is not empty; choose a new directory"),
])
def test_export_out_that_is_a_file_or_not_empty(make, expected, run_with_checkpoint, tmp_path, capsys,
                                                monkeypatch):
    make(tmp_path / "out")
    before = snapshot(tmp_path)
    line = refused(["export", run_with_checkpoint, "--out", "out"], tmp_path, capsys, monkeypatch)
    assert line == f"error: --out 'out' {expected}."
    assert snapshot(tmp_path) == before


def test_export_with_a_shard_size_of_zero(run_with_checkpoint, tmp_path, capsys, monkeypatch):
    line = refused(["export", run_with_checkpoint, "--out", "out", "--shard-size", "0"], tmp_path, capsys, monkeypatch)
    assert line == "error: --shard-size must be positive, got 0."
    assert os.listdir(tmp_path) == []
