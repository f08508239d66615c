"""Configs, paths and clusters that cannot serve a run, refused by the command line before anything
starts. Config parsing itself is covered key by key in test_config.py.

Every case runs ``megatrain-ray`` (``cli.main``, in this process unless it must not share the test
session's Ray) in a scratch working directory and checks: exit status 2, exactly one ``error:`` line
naming what to fix, no traceback, and nothing lost: no run directory or data cache created, no
shared-memory segment left, a checkpoint given to --resume unchanged (helpers in refusals.py).
"""

import os
import subprocess
import sys

import pytest

from refusals import refused, refused_train, snapshot, hf_dir, run_with_checkpoint  # noqa: F401  (fixtures)

pytest.importorskip("transformers")


def test_malformed_yaml(tmp_path, capsys, monkeypatch):
    (tmp_path / "run.yaml").write_text("train:\n  steps: [3\n")
    line = refused(["train", "--config", "run.yaml"], tmp_path, capsys, monkeypatch)
    assert "run.yaml" in line and "not valid YAML at line" in line
    assert sorted(os.listdir(tmp_path)) == ["run.yaml"]


def test_unknown_key(tmp_path, capsys, monkeypatch):
    line = refused(["train", "--set", "train.stepz=3"], tmp_path, capsys, monkeypatch)
    assert "train.stepz is not a known key" in line and "steps" in line
    assert os.listdir(tmp_path) == []


def test_wrong_type(tmp_path, capsys, monkeypatch):
    line = refused(["train", "--set", "train.micro_batch_size=eight"], tmp_path, capsys, monkeypatch)
    assert "train.micro_batch_size must be an integer" in line
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("key", ["model.hidden_size=0", "train.seq_len=-8", "train.num_micro_batches=0",
                                 "train.keep_checkpoints=0", "train.checkpoint_every=-1"])
def test_zero_or_negative_sizes(key, tmp_path, capsys, monkeypatch):
    line = refused(["train", "--set", key], tmp_path, capsys, monkeypatch)
    assert key.split("=")[0] in line
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("text,named", [
    ("train:\n  steps: 3\n  seq_len: 16\n  steps: 300\n", "the key train.steps twice (lines 2 and 4)"),
    ("train:\n  steps: 3\noptim:\n  lr: 1.0e-3\ntrain:\n  seq_len: 16\n", "the section train twice (lines 1 and 5)"),
])
def test_a_key_or_section_given_twice_in_yaml(text, named, tmp_path, shm_dir, capsys, monkeypatch):
    (tmp_path / "run.yaml").write_text(text)
    line = refused(["train", "--config", "run.yaml", "--set", f"memory.shm_dir={shm_dir}"], tmp_path, capsys,
                monkeypatch)
    assert line == f"error: config file 'run.yaml' sets {named}; YAML would keep only the last, so remove one."
    assert os.listdir(tmp_path) == ["run.yaml"] and os.listdir(shm_dir) == []


def test_a_key_given_twice_deep_inside_a_section(tmp_path, shm_dir, capsys, monkeypatch):
    (tmp_path / "run.yaml").write_text("model:\n  rope_scaling:\n    rope_type: llama3\n    factor: 8.0\n"
                                       "    factor: 32.0\n")
    line = refused(["train", "--config", "run.yaml", "--set", f"memory.shm_dir={shm_dir}"], tmp_path, capsys,
                monkeypatch)
    assert line == ("error: config file 'run.yaml' sets the key model.rope_scaling.factor twice (lines 4 and 5); "
                    "YAML would keep only the last, so remove one.")
    assert os.listdir(tmp_path) == ["run.yaml"]


def test_a_key_given_twice_in_the_config_of_a_resume(run_with_checkpoint, tmp_path, capsys, monkeypatch):
    before = snapshot(run_with_checkpoint)
    (tmp_path / "more.yaml").write_text("train:\n  steps: 6\n  steps: 8\n")
    line = refused(["train", "--resume", run_with_checkpoint, "--config", "more.yaml"], tmp_path, capsys, monkeypatch)
    assert line == ("error: config file 'more.yaml' sets the key train.steps twice (lines 2 and 3); YAML would keep "
                    "only the last, so remove one.")
    assert snapshot(run_with_checkpoint) == before and os.listdir(tmp_path) == ["more.yaml"]


def test_a_model_section_that_disagrees_with_init_from(hf_dir, tmp_path, shm_dir, capsys, monkeypatch):
    (tmp_path / "run.yaml").write_text(f"model:\n  hidden_size: 32\n  num_hidden_layers: 4\ntrain:\n"
                                       f"  init_from: {hf_dir}\n  seq_len: 32\n")
    line = refused(["train", "--config", "run.yaml", "--set", f"memory.shm_dir={shm_dir}"], tmp_path, capsys,
                monkeypatch)
    assert line == (f"error: model.num_hidden_layers (4) disagrees with train.init_from's config.json ({hf_dir}: 2), "
                    "which defines the model; remove model.num_hidden_layers from the configuration, or point "
                    "train.init_from at the model meant.")  # hidden_size 32 agrees, so it is not named
    assert os.listdir(tmp_path) == ["run.yaml"] and os.listdir(shm_dir) == []


def test_run_dir_that_is_a_file(tmp_path, capsys, monkeypatch):
    (tmp_path / "runs").write_text("not a directory")
    line = refused(["train", "--set", "train.run_dir=runs"], tmp_path, capsys, monkeypatch)
    assert "train.run_dir" in line
    assert (tmp_path / "runs").read_text() == "not a directory"


def test_run_dir_on_a_read_only_path(tmp_path, shm_dir, read_only_dir, capsys, monkeypatch):
    line = refused_train(tmp_path, capsys, monkeypatch, shm_dir, f"train.run_dir={read_only_dir / 'runs'}")
    assert line == (f"error: train.run_dir '{read_only_dir / 'runs'}' cannot be written to (a read-only file "
                    "system).")
    assert os.listdir(read_only_dir) == [] and os.listdir(shm_dir) == []


def test_run_dir_below_a_file(tmp_path, shm_dir, capsys, monkeypatch):
    (tmp_path / "notes.txt").write_text("a file where a directory would go")
    line = refused_train(tmp_path, capsys, monkeypatch, shm_dir, "train.run_dir=notes.txt/runs")
    assert line == f"error: train.run_dir 'notes.txt/runs' cannot be written to ({tmp_path / 'notes.txt'} is a file)."
    assert os.listdir(tmp_path) == ["notes.txt"] and os.listdir(shm_dir) == []


def test_shm_dir_read_only_leaves_no_run_directory(tmp_path, read_only_dir, capsys, monkeypatch):
    line = refused_train(tmp_path, capsys, monkeypatch, read_only_dir)
    assert line == f"error: memory.shm_dir '{read_only_dir}' cannot be written to (a read-only file system)."
    assert os.listdir(tmp_path) == ["ro"]  # no runs/<id>/config.json


def test_more_loader_workers_than_cpus(tmp_path, shm_dir, capsys, monkeypatch):
    line = refused_train(tmp_path, capsys, monkeypatch, shm_dir, "data.num_workers=1000", "cluster.ray_address=local")
    assert line.startswith("error: data.num_workers (1000) exceeds the ") and "set it to at most" in line
    assert os.listdir(tmp_path) == [] and os.listdir(shm_dir) == []


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
    line = refused(["train", "--set", "compute.device=cuda", "--set", f"memory.shm_dir={shm_dir}"], tmp_path,
                capsys, monkeypatch)
    assert "compute.device is cuda but no CUDA GPU is visible" in line
    assert os.listdir(tmp_path) == [] and os.listdir(shm_dir) == []


def test_plot_of_a_directory_without_metrics(tmp_path, capsys, monkeypatch):
    line = refused(["plot", "."], tmp_path, capsys, monkeypatch)
    assert "metrics.jsonl" in line
    assert os.listdir(tmp_path) == []
