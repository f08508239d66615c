"""More bad input through the real command line (issue 14): each case is one ``error:`` sentence that
names the key or file, given before Ray starts or any work is done, with nothing leaked: no run
directory or data cache created, no shared-memory segment left in the test's shm directory, no
existing checkpoint changed. The helpers and fixtures are test_bad_input.py's.
"""

import json
import os
import subprocess
import time

import numpy as np
import pytest

from megatrain_ray.io import checkpoint
from test_bad_input import _copy_run, _run, _snapshot, hf_dir, run_with_checkpoint, small_disk  # noqa: F401

transformers = pytest.importorskip("transformers")


def _train(tmp_path, capsys, monkeypatch, shm_dir, *sets: str) -> str:
    """The error line of ``megatrain-ray train --set runtime.shm_dir=SHM --set ...`` in tmp_path."""
    argv = ["train", "--set", f"runtime.shm_dir={shm_dir}"]
    for s in sets:
        argv += ["--set", s]
    return _run(argv, tmp_path, capsys, monkeypatch)


@pytest.fixture
def read_only_dir(tmp_path):
    """A real read-only directory: a read-only bind mount of tmp_path/ro (root can write anywhere else)."""
    path = tmp_path / "ro"
    path.mkdir()
    proc = subprocess.run(["mount", "--bind", "-o", "ro", str(path), str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot bind-mount read-only here: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


# ---------------------------------------------------------------------------------------------
# The cases of issue 14 that ended in a traceback, or in silence.

def test_a_garbage_npy(tmp_path, shm_dir, capsys, monkeypatch):
    (tmp_path / "tokens.npy").write_bytes(os.urandom(5000))
    line = _train(tmp_path, capsys, monkeypatch, shm_dir, "data.path=tokens.npy")
    assert line == ("error: data.path 'tokens.npy' is not a readable .npy array (it does not start with the .npy "
                    "header; write token ids with numpy.save).")
    assert os.listdir(tmp_path) == ["tokens.npy"] and os.listdir(shm_dir) == []


def test_a_negative_id_in_a_token_stream_is_the_one_named(tmp_path, shm_dir, capsys, monkeypatch):
    tokens = np.arange(1000) % 200  # every id valid but one
    tokens[500] = -3
    np.save(tmp_path / "tokens.npy", tokens)
    line = _train(tmp_path, capsys, monkeypatch, shm_dir, "data.path=tokens.npy")
    assert "holds token id -3 (at index 500), outside [0, model.vocab_size (260))" in line
    assert os.listdir(tmp_path) == ["tokens.npy"] and os.listdir(shm_dir) == []


def test_run_dir_on_a_read_only_path(tmp_path, shm_dir, read_only_dir, capsys, monkeypatch):
    line = _train(tmp_path, capsys, monkeypatch, shm_dir, f"runtime.run_dir={read_only_dir / 'runs'}")
    assert line == (f"error: runtime.run_dir '{read_only_dir / 'runs'}' cannot be written to (a read-only file "
                    "system).")
    assert os.listdir(read_only_dir) == [] and os.listdir(shm_dir) == []


def test_shm_dir_read_only_leaves_no_run_directory(tmp_path, read_only_dir, capsys, monkeypatch):
    line = _train(tmp_path, capsys, monkeypatch, read_only_dir)
    assert line == f"error: runtime.shm_dir '{read_only_dir}' cannot be written to (a read-only file system)."
    assert os.listdir(tmp_path) == ["ro"]  # no runs/<id>/config.json


def test_export_out_on_a_read_only_path(run_with_checkpoint, tmp_path, read_only_dir, capsys, monkeypatch):
    before = _snapshot(run_with_checkpoint)
    line = _run(["export", run_with_checkpoint, "--out", read_only_dir / "model"], tmp_path, capsys, monkeypatch)
    assert line == (f"error: --out '{read_only_dir / 'model'}' cannot be written to (a read-only file system); "
                    "choose a writable directory.")
    assert _snapshot(run_with_checkpoint) == before and os.listdir(read_only_dir) == []


def test_a_garbage_tokenizer_json_is_named_before_the_tokenizer_pool_starts(tmp_path, shm_dir, capsys,
                                                                            monkeypatch):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    (tmp_path / "docs.txt").write_text("One document.\n\nAnother one.\n")
    start = time.monotonic()
    line = _train(tmp_path, capsys, monkeypatch, shm_dir, "data.path=docs.txt", "data.format=text",
                  "data.tokenizer=tok", "runtime.ray_address=127.0.0.1:1")  # no Ray may be reached for it
    assert line.startswith(f"error: data.tokenizer '{tmp_path / 'tok'}' is not a loadable Hugging Face tokenizer ")
    assert "\x1b[" not in line and time.monotonic() - start < 30
    assert sorted(os.listdir(tmp_path)) == ["docs.txt", "tok"] and os.listdir(shm_dir) == []  # no data cache


def test_jsonl_input_ids_given_as_strings(tmp_path, shm_dir, capsys, monkeypatch):
    (tmp_path / "ids.jsonl").write_text('{"input_ids": "1 2 3 4"}\n{"input_ids": [5, 6]}\n')
    line = _train(tmp_path, capsys, monkeypatch, shm_dir, "data.path=ids.jsonl", "runtime.ray_address=127.0.0.1:1")
    assert line == ("error: data.path 'ids.jsonl': the first row's input_ids must be a list of integer token ids, "
                    "got '1 2 3 4'.")
    assert os.listdir(tmp_path) == ["ids.jsonl"] and os.listdir(shm_dir) == []


def test_more_loader_workers_than_cpus(tmp_path, shm_dir, capsys, monkeypatch):
    line = _train(tmp_path, capsys, monkeypatch, shm_dir, "data.num_workers=1000", "runtime.ray_address=local")
    assert line.startswith("error: data.num_workers (1000) exceeds the ") and "set it to at most" in line
    assert os.listdir(tmp_path) == [] and os.listdir(shm_dir) == []


@pytest.mark.parametrize("text,named", [
    ("train:\n  steps: 3\n  seq_len: 16\n  steps: 300\n", "the key train.steps twice (lines 2 and 4)"),
    ("train:\n  steps: 3\noptim:\n  lr: 1.0e-3\ntrain:\n  seq_len: 16\n", "the section train twice (lines 1 and 5)"),
])
def test_a_key_or_section_given_twice_in_yaml(text, named, tmp_path, shm_dir, capsys, monkeypatch):
    (tmp_path / "run.yaml").write_text(text)
    line = _run(["train", "--config", "run.yaml", "--set", f"runtime.shm_dir={shm_dir}"], tmp_path, capsys,
                monkeypatch)
    assert line == f"error: config file 'run.yaml' sets {named}; YAML would keep only the last, so remove one."
    assert os.listdir(tmp_path) == ["run.yaml"] and os.listdir(shm_dir) == []


def test_a_model_section_that_disagrees_with_init_from(hf_dir, tmp_path, shm_dir, capsys, monkeypatch):
    (tmp_path / "run.yaml").write_text(f"model:\n  hidden_size: 32\n  num_hidden_layers: 4\nruntime:\n"
                                       f"  init_from: {hf_dir}\ntrain:\n  seq_len: 32\n")
    line = _run(["train", "--config", "run.yaml", "--set", f"runtime.shm_dir={shm_dir}"], tmp_path, capsys,
                monkeypatch)
    assert line == (f"error: model.num_hidden_layers (4) disagrees with runtime.init_from's config.json ({hf_dir}: 2), "
                    "which defines the model; remove model.num_hidden_layers from the configuration, or point "
                    "runtime.init_from at the model meant.")  # hidden_size 32 agrees, so it is not named
    assert os.listdir(tmp_path) == ["run.yaml"] and os.listdir(shm_dir) == []
