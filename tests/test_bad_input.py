"""Bad input, through the real command line: one clear sentence, a non-zero exit, nothing lost.

Every case runs ``megatrain-ray`` (``cli.main``, in this process unless it must not share the test
session's Ray) in a scratch working directory and checks: exit status 2, exactly one ``error:``
line naming what to fix, no traceback, and nothing lost — no run directory or file created, a
checkpoint given to --resume unchanged, no shared-memory segment left. Config parsing itself is
covered key by key in test_config.py.

The failures that happen mid-run (a diverging loss, a full disk while checkpointing) train through
the real pipeline and check that the last good checkpoint is intact and named in the message.
"""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatrain_ray import cli
from megatrain_ray.config import load_config
from megatrain_ray.data.loader import source_from_config
from megatrain_ray.engine.store import ParameterStore, StoreSpec
from megatrain_ray.io import checkpoint, writer
from megatrain_ray.model.precision import Precision

transformers = pytest.importorskip("transformers")


def _run(argv, cwd, capsys, monkeypatch) -> str:
    """cli.main(argv) in ``cwd``; asserts status 2 and one error line; returns that line."""
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert status == 2, (out, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def _snapshot(root) -> dict[str, str]:
    """{relative path: sha256} of every file under root."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny real Llama checkpoint written by transformers' save_pretrained."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("hf") / "llama"
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def run_with_checkpoint(tmp_path_factory):
    """A run directory holding one real checkpoint (step 2 of 4) of the default tiny model."""
    base = tmp_path_factory.mktemp("ckpt")
    shm_dir = base / "shm"
    shm_dir.mkdir()
    cfg = load_config(None, [f"memory.shm_dir={shm_dir}", f"train.run_dir={base / 'runs'}", "train.steps=4",
                             "compute.device=cpu"])
    spec = StoreSpec(cfg.model, Precision(torch.float32, torch.float32), str(shm_dir), os.getpid(), "bad-input")
    ps = ParameterStore(spec, 0)
    try:
        for i in range(len(ps.store.layout.units)):
            ps.store.set_version(i, 2)
        run = base / "runs" / "run-1"
        data_state = {k: v for k, v in source_from_config(cfg).state(0).items() if k != "next_step"}
        writer.save(ps.store, str(run / "checkpoints"), 2, cfg.to_dict(), "run-1", data_state)
    finally:
        ps.close()
    return run


def _copy_run(run, tmp_path):
    import shutil

    dst = tmp_path / "copied-run"
    shutil.copytree(run, dst)
    return dst


# ---------------------------------------------------------------------------------------------
# Before anything runs: config, weights, data, checkpoints.

def test_malformed_yaml(tmp_path, capsys, monkeypatch):
    (tmp_path / "run.yaml").write_text("train:\n  steps: [3\n")
    line = _run(["train", "--config", "run.yaml"], tmp_path, capsys, monkeypatch)
    assert "run.yaml" in line and "not valid YAML at line" in line
    assert sorted(os.listdir(tmp_path)) == ["run.yaml"]


def test_unknown_key(tmp_path, capsys, monkeypatch):
    line = _run(["train", "--set", "train.stepz=3"], tmp_path, capsys, monkeypatch)
    assert "train.stepz is not a known key" in line and "steps" in line
    assert os.listdir(tmp_path) == []


def test_wrong_type(tmp_path, capsys, monkeypatch):
    line = _run(["train", "--set", "train.micro_batch_size=eight"], tmp_path, capsys, monkeypatch)
    assert "train.micro_batch_size must be an integer" in line
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("key", ["model.hidden_size=0", "train.seq_len=-8", "train.num_micro_batches=0",
                                 "train.keep_checkpoints=0", "train.checkpoint_every=-1"])
def test_zero_or_negative_sizes(key, tmp_path, capsys, monkeypatch):
    line = _run(["train", "--set", key], tmp_path, capsys, monkeypatch)
    assert key.split("=")[0] in line
    assert os.listdir(tmp_path) == []


def test_seq_len_above_the_checkpoint_max_positions(hf_dir, tmp_path, capsys, monkeypatch):
    line = _run(["train", "--set", f"train.init_from={hf_dir}", "--set", "train.seq_len=256"], tmp_path,
                capsys, monkeypatch)
    assert "train.seq_len (256) exceeds model.max_position_embeddings (128)" in line
    assert os.listdir(tmp_path) == []


def _init_from(tmp_path, capsys, monkeypatch, config: str, weights: bytes | None) -> str:
    """The error line of a run initialised from tmp_path/model holding this config.json and weights."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(config)
    if weights is not None:
        (model / "model.safetensors").write_bytes(weights)
    return _run(["train", "--set", f"train.init_from={model}", "--set", "train.seq_len=32"], tmp_path,
                capsys, monkeypatch)


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


def test_data_ids_outside_the_model_vocabulary(tmp_path, capsys, monkeypatch):
    np.save(tmp_path / "tokens.npy", np.arange(1000) % 500)  # ids up to 499, vocab 260
    line = _run(["train", "--set", "data.path=tokens.npy"], tmp_path, capsys, monkeypatch)
    assert "499" in line and "model.vocab_size (260)" in line
    assert sorted(os.listdir(tmp_path)) == ["tokens.npy"]


def test_empty_dataset(tmp_path, capsys, monkeypatch):
    (tmp_path / "corpus.txt").write_text("")
    line = _run(["train", "--set", "data.path=corpus.txt"], tmp_path, capsys, monkeypatch)
    assert "corpus.txt" in line
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt"]


def test_unreadable_dataset(tmp_path, capsys, monkeypatch):
    (tmp_path / "corpus.txt").write_bytes(b"\xff\xfe\x00 not utf-8 \x80\x81" * 100)
    line = _run(["train", "--set", "data.path=corpus.txt"], tmp_path, capsys, monkeypatch)
    assert "corpus.txt" in line and ("UTF-8" in line or "utf-8" in line)
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt"]


def test_dataset_of_floats(tmp_path, capsys, monkeypatch):
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).random(1000))
    line = _run(["train", "--set", "data.path=tokens.npy"], tmp_path, capsys, monkeypatch)
    assert "tokens.npy" in line and "integer" in line
    assert sorted(os.listdir(tmp_path)) == ["tokens.npy"]


def test_dataset_shorter_than_one_sequence(tmp_path, capsys, monkeypatch):
    np.save(tmp_path / "tokens.npy", np.arange(20))
    line = _run(["train", "--set", "data.path=tokens.npy", "--set", "train.seq_len=64"], tmp_path, capsys,
                monkeypatch)
    assert "tokens.npy" in line and "train.seq_len" in line
    assert sorted(os.listdir(tmp_path)) == ["tokens.npy"]


def test_run_dir_that_is_a_file(tmp_path, capsys, monkeypatch):
    (tmp_path / "runs").write_text("not a directory")
    line = _run(["train", "--set", "train.run_dir=runs"], tmp_path, capsys, monkeypatch)
    assert "train.run_dir" in line
    assert (tmp_path / "runs").read_text() == "not a directory"


def test_resume_from_a_missing_path(tmp_path, capsys, monkeypatch):
    line = _run(["train", "--resume", "runs/nope"], tmp_path, capsys, monkeypatch)
    assert "--resume 'runs/nope' is not a directory" in line
    assert os.listdir(tmp_path) == []


def test_resume_from_a_run_without_checkpoints(tmp_path, capsys, monkeypatch):
    (tmp_path / "runs" / "run-0").mkdir(parents=True)
    line = _run(["train", "--resume", "runs/run-0"], tmp_path, capsys, monkeypatch)
    assert "holds no checkpoint" in line
    assert os.listdir(tmp_path / "runs" / "run-0") == []


def test_resume_with_a_checkpoint_of_another_model(run_with_checkpoint, tmp_path, capsys, monkeypatch):
    before = _snapshot(run_with_checkpoint)
    line = _run(["train", "--resume", run_with_checkpoint, "--set", "model.hidden_size=32"], tmp_path, capsys,
                monkeypatch)
    assert "holds a different model" in line and "hidden_size 64 vs 32" in line
    assert _snapshot(run_with_checkpoint) == before
    assert os.listdir(tmp_path) == []


def test_resume_with_a_truncated_checkpoint(run_with_checkpoint, tmp_path, capsys, monkeypatch):
    run = _copy_run(run_with_checkpoint, tmp_path)
    shard = run / "checkpoints" / "step-000002" / "optimizer-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    line = _run(["train", "--resume", run], tmp_path, capsys, monkeypatch)
    assert "optimizer-00001-of-00001.safetensors" in line and "corrupt" in line
    assert sorted(os.listdir(run)) == ["checkpoints"]


def test_resume_with_a_broken_meta_json(run_with_checkpoint, tmp_path, capsys, monkeypatch):
    run = _copy_run(run_with_checkpoint, tmp_path)
    (run / "checkpoints" / "step-000002" / "meta.json").write_text("{")
    line = _run(["train", "--resume", run / "checkpoints" / "step-000002"], tmp_path, capsys, monkeypatch)
    assert "meta.json" in line and "step-000002" in line


def test_resume_with_other_data(run_with_checkpoint, tmp_path, capsys, monkeypatch):
    (tmp_path / "other.txt").write_text("Some other text that the run was not trained on.\n" * 50)
    before = _snapshot(run_with_checkpoint)
    line = _run(["train", "--resume", run_with_checkpoint, "--set", "data.path=other.txt"], tmp_path, capsys,
                monkeypatch)
    assert line.startswith("error: cannot resume: the checkpoint was trained on other tokens (the text of data.path "
                           "changed since, or another file is named); ")
    assert _snapshot(run_with_checkpoint) == before
    assert sorted(os.listdir(tmp_path)) == ["other.txt"]


def test_resume_with_nothing_left_to_train(run_with_checkpoint, tmp_path, capsys, monkeypatch):
    line = _run(["train", "--resume", run_with_checkpoint, "--set", "train.steps=2"], tmp_path, capsys,
                monkeypatch)
    assert "train.steps (2)" in line and "step (2)" in line
    assert os.listdir(tmp_path) == []


def test_plot_of_a_directory_without_metrics(tmp_path, capsys, monkeypatch):
    line = _run(["plot", "."], tmp_path, capsys, monkeypatch)
    assert "metrics.jsonl" in line
    assert os.listdir(tmp_path) == []


def test_ray_address_unreachable(tmp_path):
    """Its own process: the test session's Ray must not be the one it connects to."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "megatrain_ray.cli", "train", "--set",
                           "cluster.ray_address=127.0.0.1:1"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach the Ray cluster at '127.0.0.1:1'"), proc.stderr
    assert os.listdir(tmp_path) == []


def test_cuda_requested_without_a_gpu(ray_cluster, shm_dir, tmp_path, capsys, monkeypatch):
    line = _run(["train", "--set", "compute.device=cuda", "--set", f"memory.shm_dir={shm_dir}"], tmp_path,
                capsys, monkeypatch)
    assert "compute.device is cuda but no CUDA GPU is visible" in line
    assert os.listdir(tmp_path) == [] and os.listdir(shm_dir) == []


# ---------------------------------------------------------------------------------------------
# During a run: the last good checkpoint survives.

@pytest.mark.parametrize("resident", ["none", "embed_head"])  # embed_head: the compute worker updates its units too
def test_diverging_loss_stops_and_keeps_the_last_good_checkpoint(resident, ray_cluster, shm_dir, tmp_path, capsys,
                                                                 monkeypatch):
    # lr 1e30: step 1 is finite, its update blows the weights up, step 2's loss is not finite.
    line = _run(["train", "--set", f"memory.shm_dir={shm_dir}", "--set", "compute.device=cpu",
                 "--set", "optim.lr=1e30", "--set", "train.steps=6", "--set", "train.checkpoint_every=1",
                 "--set", "cluster.actor_timeout_s=120", "--set", f"memory.resident={resident}"],
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
    line = _run(["train", "--set", f"memory.shm_dir={shm_dir}", "--set", f"train.run_dir={small_disk}",
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
    line = _run(["train", "--set", f"memory.shm_dir={shm_dir}", "--set", f"train.run_dir={small_disk}",
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
