"""More bad input through the real command line (issue 14): each case is one ``error:`` sentence that
names the key or file, given before Ray starts or any work is done, with nothing leaked: no run
directory or data cache created, no shared-memory segment left in the test's shm directory, no
existing checkpoint changed. The helpers and fixtures are test_bad_input.py's.
"""

import json
import os
import time

import numpy as np
import pytest

from megatrain_ray.io import checkpoint
from test_bad_input import _copy_run, _run, _snapshot, hf_dir, run_with_checkpoint  # noqa: F401

transformers = pytest.importorskip("transformers")


def _train(tmp_path, capsys, monkeypatch, shm_dir, *sets: str) -> str:
    """The error line of ``megatrain-ray train --set memory.shm_dir=SHM --set ...`` in tmp_path."""
    argv = ["train", "--set", f"memory.shm_dir={shm_dir}"]
    for s in sets:
        argv += ["--set", s]
    return _run(argv, tmp_path, capsys, monkeypatch)


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
    line = _train(tmp_path, capsys, monkeypatch, shm_dir, f"train.run_dir={read_only_dir / 'runs'}")
    assert line == (f"error: train.run_dir '{read_only_dir / 'runs'}' cannot be written to (a read-only file "
                    "system).")
    assert os.listdir(read_only_dir) == [] and os.listdir(shm_dir) == []


def test_shm_dir_read_only_leaves_no_run_directory(tmp_path, read_only_dir, capsys, monkeypatch):
    line = _train(tmp_path, capsys, monkeypatch, read_only_dir)
    assert line == f"error: memory.shm_dir '{read_only_dir}' cannot be written to (a read-only file system)."
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
                  "data.tokenizer=tok", "cluster.ray_address=127.0.0.1:1")  # no Ray may be reached for it
    assert line.startswith(f"error: data.tokenizer '{tmp_path / 'tok'}' is not a loadable Hugging Face tokenizer ")
    assert "\x1b[" not in line and time.monotonic() - start < 30
    assert sorted(os.listdir(tmp_path)) == ["docs.txt", "tok"] and os.listdir(shm_dir) == []  # no data cache


def test_jsonl_input_ids_given_as_strings(tmp_path, shm_dir, capsys, monkeypatch):
    (tmp_path / "ids.jsonl").write_text('{"input_ids": "1 2 3 4"}\n{"input_ids": [5, 6]}\n')
    line = _train(tmp_path, capsys, monkeypatch, shm_dir, "data.path=ids.jsonl", "cluster.ray_address=127.0.0.1:1")
    assert line == ("error: data.path 'ids.jsonl': the first row's input_ids must be a list of integer token ids, "
                    "got '1 2 3 4'.")
    assert os.listdir(tmp_path) == ["ids.jsonl"] and os.listdir(shm_dir) == []


def test_more_loader_workers_than_cpus(tmp_path, shm_dir, capsys, monkeypatch):
    line = _train(tmp_path, capsys, monkeypatch, shm_dir, "data.num_workers=1000", "cluster.ray_address=local")
    assert line.startswith("error: data.num_workers (1000) exceeds the ") and "set it to at most" in line
    assert os.listdir(tmp_path) == [] and os.listdir(shm_dir) == []


@pytest.mark.parametrize("text,named", [
    ("train:\n  steps: 3\n  seq_len: 16\n  steps: 300\n", "the key train.steps twice (lines 2 and 4)"),
    ("train:\n  steps: 3\noptim:\n  lr: 1.0e-3\ntrain:\n  seq_len: 16\n", "the section train twice (lines 1 and 5)"),
])
def test_a_key_or_section_given_twice_in_yaml(text, named, tmp_path, shm_dir, capsys, monkeypatch):
    (tmp_path / "run.yaml").write_text(text)
    line = _run(["train", "--config", "run.yaml", "--set", f"memory.shm_dir={shm_dir}"], tmp_path, capsys,
                monkeypatch)
    assert line == f"error: config file 'run.yaml' sets {named}; YAML would keep only the last, so remove one."
    assert os.listdir(tmp_path) == ["run.yaml"] and os.listdir(shm_dir) == []


def test_a_model_section_that_disagrees_with_init_from(hf_dir, tmp_path, shm_dir, capsys, monkeypatch):
    (tmp_path / "run.yaml").write_text(f"model:\n  hidden_size: 32\n  num_hidden_layers: 4\ntrain:\n"
                                       f"  init_from: {hf_dir}\n  seq_len: 32\n")
    line = _run(["train", "--config", "run.yaml", "--set", f"memory.shm_dir={shm_dir}"], tmp_path, capsys,
                monkeypatch)
    assert line == (f"error: model.num_hidden_layers (4) disagrees with train.init_from's config.json ({hf_dir}: 2), "
                    "which defines the model; remove model.num_hidden_layers from the configuration, or point "
                    "train.init_from at the model meant.")  # hidden_size 32 agrees, so it is not named
    assert os.listdir(tmp_path) == ["run.yaml"] and os.listdir(shm_dir) == []


# ---------------------------------------------------------------------------------------------
# Checkpoints that changed on disk: refused (or skipped) by name, and left as they are.

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
    run = _copy_run(run_with_checkpoint, tmp_path)
    damage(run / STEP)
    return run, run / STEP, _snapshot(run)


def test_resume_of_a_checkpoint_whose_bytes_changed_but_not_its_size(run_with_checkpoint, tmp_path, shm_dir, capsys,
                                                                     monkeypatch):
    shards = []
    run, step, before = _damaged(run_with_checkpoint, tmp_path, lambda d: shards.append(_flip_bit(d)))
    line = _run(["train", "--resume", step, "--set", f"memory.shm_dir={shm_dir}"], tmp_path, capsys, monkeypatch)
    assert line.startswith(f"error: checkpoint {step} is corrupt: {shards[0]} does not match the checksum written "
                           "with it (crc32 ")
    assert line.endswith("although its size does: its bytes changed on disk; use an earlier checkpoint of the run.")
    assert _snapshot(run) == before and os.listdir(shm_dir) == []


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
    line = _run(["train", "--resume", run, "--set", f"memory.shm_dir={shm_dir}"], tmp_path, capsys, monkeypatch)
    assert line.startswith(f"error: --resume '{run}' holds no valid checkpoint: {step} is corrupt ({named}")
    assert _snapshot(run) == before and sorted(os.listdir(tmp_path)) == ["copied-run"]
    assert os.listdir(shm_dir) == []


def test_resume_of_a_checkpoint_from_a_newer_megatrain_ray(run_with_checkpoint, tmp_path, capsys, monkeypatch):
    def newer(d):
        meta = json.loads((d / "meta.json").read_text())
        (d / "meta.json").write_text(json.dumps({**meta, "format_version": 99}))

    run, step, before = _damaged(run_with_checkpoint, tmp_path, newer)
    line = _run(["train", "--resume", step], tmp_path, capsys, monkeypatch)
    assert line == (f"error: checkpoint {step} cannot be read: it has format version 99, newer than this "
                    f"megatrain-ray reads ({checkpoint.FORMAT_VERSION}); upgrade megatrain-ray.")
    assert _snapshot(run) == before


@pytest.mark.parametrize("command", ["export", "eval"])
def test_export_and_eval_refuse_a_checkpoint_whose_bytes_changed(command, run_with_checkpoint, tmp_path, capsys,
                                                                 monkeypatch):
    run, step, before = _damaged(run_with_checkpoint, tmp_path, _flip_bit)
    argv = [command, step] + (["--out", tmp_path / "out"] if command == "export" else [])
    line = _run(argv, tmp_path, capsys, monkeypatch)
    assert line.startswith(f"error: checkpoint {step} is corrupt: model-00001-of-00001.safetensors does not match")
    assert _snapshot(run) == before and sorted(os.listdir(tmp_path)) == ["copied-run"]


def test_export_of_a_model_directory_with_a_shard_cut_short(hf_dir, tmp_path, capsys, monkeypatch):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(hf_dir, model)
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[:len(data) - 100])
    line = _run(["export", model, "--out", tmp_path / "out"], tmp_path, capsys, monkeypatch)
    assert line == (f"error: the checkpoint's model.safetensors in '{model}' is missing or corrupt (its header "
                    f"describes {len(data) - 8 - int.from_bytes(data[:8], 'little')} bytes of tensors but the file "
                    f"holds {len(data) - 108 - int.from_bytes(data[:8], 'little')} (cut short)); re-save the model "
                    "(save_pretrained) or export it again.")
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
    line = _train(tmp_path, capsys, monkeypatch, shm_dir, f"train.init_from={tmp_path / 'hf'}", "train.seq_len=32")
    assert line.startswith(f"error: train.init_from's {shards[1]} in '{tmp_path / 'hf'}' is missing or corrupt (")
    assert sorted(os.listdir(tmp_path)) == ["hf"] and os.listdir(shm_dir) == []


@pytest.mark.parametrize("make,expected", [
    (lambda p: p.write_text(""), "is a file; choose a new directory"),
    (lambda p: (p.mkdir(), (p / "x").write_text("")), "exists and is not empty; choose a new directory"),
])
def test_export_out_that_is_a_file_or_not_empty(make, expected, run_with_checkpoint, tmp_path, capsys,
                                                monkeypatch):
    make(tmp_path / "out")
    before = _snapshot(tmp_path)
    line = _run(["export", run_with_checkpoint, "--out", "out"], tmp_path, capsys, monkeypatch)
    assert line == f"error: --out 'out' {expected}."
    assert _snapshot(tmp_path) == before


def test_export_with_a_shard_size_of_zero(run_with_checkpoint, tmp_path, capsys, monkeypatch):
    line = _run(["export", run_with_checkpoint, "--out", "out", "--shard-size", "0"], tmp_path, capsys, monkeypatch)
    assert line == "error: --shard-size must be positive, got 0."
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# Data and configuration.

@pytest.mark.parametrize("row,shown", [
    ('{"input_ids": [1.5, 2.0, 3.0]}', "[1.5, 2.0, 3.0]"),
    ('{"input_ids": [[1, 2], [3]]}', "[[1, 2], [3]]"),
    ('{"input_ids": null}', "None"),
])
def test_jsonl_input_ids_that_are_not_integers(row, shown, tmp_path, shm_dir, capsys, monkeypatch):
    (tmp_path / "ids.jsonl").write_text(row + "\n")
    line = _train(tmp_path, capsys, monkeypatch, shm_dir, "data.path=ids.jsonl", "cluster.ray_address=127.0.0.1:1")
    assert line == (f"error: data.path 'ids.jsonl': the first row's input_ids must be a list of integer token ids, "
                    f"got {shown}.")
    assert os.listdir(tmp_path) == ["ids.jsonl"] and os.listdir(shm_dir) == []


def test_parquet_input_ids_stored_as_text(tmp_path, shm_dir, capsys, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input_ids": ["1 2 3", "4 5 6"]}), tmp_path / "ids.parquet")
    line = _train(tmp_path, capsys, monkeypatch, shm_dir, "data.path=ids.parquet", "cluster.ray_address=127.0.0.1:1")
    assert line == ("error: data.path 'ids.parquet': the first row's input_ids must be a list of integer token ids, "
                    "but the column is string.")
    assert os.listdir(tmp_path) == ["ids.parquet"] and os.listdir(shm_dir) == []


@pytest.mark.parametrize("array,expected", [
    (np.zeros((4, 5, 6), dtype=np.int64), "must hold a 1-D stream or a 2-D array of rows of token ids, got a 3-D "
                                          "array of shape (4, 5, 6)"),
    (np.array([[1, 2, 3, 4] * 10, [5, -7, 8, 9] * 10]), "holds the negative token id -7 (at flat index 41)"),
    (np.zeros(0, dtype=np.int64), "has 0 tokens, fewer than train.seq_len + 2 (18)"),
])
def test_npy_arrays_of_the_wrong_shape_or_values(array, expected, tmp_path, shm_dir, capsys, monkeypatch):
    np.save(tmp_path / "tokens.npy", array)
    line = _train(tmp_path, capsys, monkeypatch, shm_dir, "data.path=tokens.npy", "train.seq_len=16")
    assert expected in line and "tokens.npy" in line
    assert os.listdir(tmp_path) == ["tokens.npy"] and os.listdir(shm_dir) == []


def test_a_key_given_twice_deep_inside_a_section(tmp_path, shm_dir, capsys, monkeypatch):
    (tmp_path / "run.yaml").write_text("model:\n  rope_scaling:\n    rope_type: llama3\n    factor: 8.0\n"
                                       "    factor: 32.0\n")
    line = _run(["train", "--config", "run.yaml", "--set", f"memory.shm_dir={shm_dir}"], tmp_path, capsys,
                monkeypatch)
    assert line == ("error: config file 'run.yaml' sets the key model.rope_scaling.factor twice (lines 4 and 5); "
                    "YAML would keep only the last, so remove one.")
    assert os.listdir(tmp_path) == ["run.yaml"]


def test_a_key_given_twice_in_the_config_of_a_resume(run_with_checkpoint, tmp_path, capsys, monkeypatch):
    before = _snapshot(run_with_checkpoint)
    (tmp_path / "more.yaml").write_text("train:\n  steps: 6\n  steps: 8\n")
    line = _run(["train", "--resume", run_with_checkpoint, "--config", "more.yaml"], tmp_path, capsys, monkeypatch)
    assert line == ("error: config file 'more.yaml' sets the key train.steps twice (lines 2 and 3); YAML would keep "
                    "only the last, so remove one.")
    assert _snapshot(run_with_checkpoint) == before and os.listdir(tmp_path) == ["more.yaml"]


def test_run_dir_below_a_file(tmp_path, shm_dir, capsys, monkeypatch):
    (tmp_path / "notes.txt").write_text("a file where a directory would go")
    line = _train(tmp_path, capsys, monkeypatch, shm_dir, "train.run_dir=notes.txt/runs")
    assert line == f"error: train.run_dir 'notes.txt/runs' cannot be written to ({tmp_path / 'notes.txt'} is a file)."
    assert os.listdir(tmp_path) == ["notes.txt"] and os.listdir(shm_dir) == []
