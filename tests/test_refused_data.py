"""Training and validation data that cannot be read as asked, refused by the command line with one
sentence naming the key and the file, before Ray is reached or any actor starts.

Every case runs ``megatrain-ray`` (``cli.main``, in this process unless it must not share the test
session's Ray) in a scratch working directory and checks: exit status 2, exactly one ``error:`` line
naming what to fix, no traceback, and nothing lost: no run directory or data cache created, no
shared-memory segment left, a checkpoint given to --resume unchanged (helpers in refusals.py).

The validation files run with ``cluster.ray_address=127.0.0.1:1``, an address where no Ray answers:
reaching for Ray would end in a different error.
"""

import os
import time

import numpy as np
import pytest

from refusals import refused, refused_train

pytest.importorskip("transformers")


def _write(tmp_path, name: str) -> str:
    path = tmp_path / name
    if name == "garbage.npy":
        path.write_bytes(os.urandom(5000))
    elif name == "floats.npy":
        np.save(path, np.ones(1000))
    elif name == "negative.npy":
        np.save(path, np.arange(1000) - 5)
    elif name == "short.npy":
        np.save(path, np.arange(10))
    elif name == "strings.jsonl":
        path.write_text('{"input_ids": "1 2 3"}\n')
    elif name == "no_text.jsonl":
        path.write_text('{"body": "x"}\n')
    elif name == "binary.txt":
        path.write_bytes(b"\xff\xfe\x00garbage" + os.urandom(3000))
    elif name == "empty_dir":
        path.mkdir()
        (path / "notes.md").write_text("not data")
    return name


@pytest.mark.parametrize("name,expected", [
    ("missing.npy", "error: data.val_path does not name a readable file or directory: 'missing.npy'."),
    ("garbage.npy", "error: data.val_path 'garbage.npy' is not a readable .npy array (it does not start with the "
                    ".npy header; write token ids with numpy.save)."),
    ("floats.npy", "error: data.val_path 'floats.npy' must hold integer token ids, got float64."),
    ("negative.npy", "error: data.val_path 'negative.npy' holds the negative token id -5 (at flat index 0); token "
                     "ids must be non-negative."),
    ("short.npy", "error: data.val_path 'short.npy' has 10 val tokens, fewer than train.seq_len + 1 (65); use more "
                  "data or a shorter train.seq_len."),
    ("strings.jsonl", "error: data.val_path 'strings.jsonl': the first row's input_ids must be a list of integer "
                      "token ids, got '1 2 3'."),
    ("no_text.jsonl", "error: data.val_path 'no_text.jsonl' has columns body, which match no data format; set "
                      "data.format, or data.text_key for plain text."),
    ("binary.txt", "error: data.val_path 'binary.txt' is not UTF-8 text (invalid start byte at byte 0); give a text "
                   "file, or token ids as .npy."),
    ("empty_dir", "holds no .txt, .jsonl, .json, .parquet, .arrow or .npy file."),
])
def test_a_bad_validation_file_is_one_sentence_before_ray(name, expected, tmp_path, shm_dir, capsys, monkeypatch):
    _write(tmp_path, name)
    before = sorted(os.listdir(tmp_path))
    line = refused(["train", "--set", "train.eval_every=2", "--set", f"data.val_path={name}",
                 "--set", "cluster.ray_address=127.0.0.1:1", "--set", f"memory.shm_dir={shm_dir}"],
                tmp_path, capsys, monkeypatch)
    assert "data.val_path" in line and "Ray" not in line, line
    assert line == expected if expected.startswith("error: ") else line.endswith(expected), line
    assert sorted(os.listdir(tmp_path)) == before  # no runs/, no data cache
    assert os.listdir(shm_dir) == []


def test_data_ids_outside_the_model_vocabulary(tmp_path, capsys, monkeypatch):
    np.save(tmp_path / "tokens.npy", np.arange(1000) % 500)  # ids up to 499, vocab 260
    line = refused(["train", "--set", "data.path=tokens.npy"], tmp_path, capsys, monkeypatch)
    assert "499" in line and "model.vocab_size (260)" in line
    assert sorted(os.listdir(tmp_path)) == ["tokens.npy"]


def test_empty_dataset(tmp_path, capsys, monkeypatch):
    (tmp_path / "corpus.txt").write_text("")
    line = refused(["train", "--set", "data.path=corpus.txt"], tmp_path, capsys, monkeypatch)
    assert "corpus.txt" in line
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt"]


def test_unreadable_dataset(tmp_path, capsys, monkeypatch):
    (tmp_path / "corpus.txt").write_bytes(b"\xff\xfe\x00 not utf-8 \x80\x81" * 100)
    line = refused(["train", "--set", "data.path=corpus.txt"], tmp_path, capsys, monkeypatch)
    assert "corpus.txt" in line and ("UTF-8" in line or "utf-8" in line)
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt"]


def test_dataset_of_floats(tmp_path, capsys, monkeypatch):
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).random(1000))
    line = refused(["train", "--set", "data.path=tokens.npy"], tmp_path, capsys, monkeypatch)
    assert "tokens.npy" in line and "integer" in line
    assert sorted(os.listdir(tmp_path)) == ["tokens.npy"]


def test_dataset_shorter_than_one_sequence(tmp_path, capsys, monkeypatch):
    np.save(tmp_path / "tokens.npy", np.arange(20))
    line = refused(["train", "--set", "data.path=tokens.npy", "--set", "train.seq_len=64"], tmp_path, capsys,
                monkeypatch)
    assert "tokens.npy" in line and "train.seq_len" in line
    assert sorted(os.listdir(tmp_path)) == ["tokens.npy"]


def test_a_garbage_npy(tmp_path, shm_dir, capsys, monkeypatch):
    (tmp_path / "tokens.npy").write_bytes(os.urandom(5000))
    line = refused_train(tmp_path, capsys, monkeypatch, shm_dir, "data.path=tokens.npy")
    assert line == ("error: data.path 'tokens.npy' is not a readable .npy array (it does not start with the .npy "
                    "header; write token ids with numpy.save).")
    assert os.listdir(tmp_path) == ["tokens.npy"] and os.listdir(shm_dir) == []


def test_a_negative_id_in_a_token_stream_is_the_one_named(tmp_path, shm_dir, capsys, monkeypatch):
    tokens = np.arange(1000) % 200  # every id valid but one
    tokens[500] = -3
    np.save(tmp_path / "tokens.npy", tokens)
    line = refused_train(tmp_path, capsys, monkeypatch, shm_dir, "data.path=tokens.npy")
    assert "holds token id -3 (at index 500), outside [0, model.vocab_size (260))" in line
    assert os.listdir(tmp_path) == ["tokens.npy"] and os.listdir(shm_dir) == []


@pytest.mark.parametrize("array,expected", [
    (np.zeros((4, 5, 6), dtype=np.int64), "must hold a 1-D stream or a 2-D array of rows of token ids, got a 3-D "
                                          "array of shape (4, 5, 6)"),
    (np.array([[1, 2, 3, 4] * 10, [5, -7, 8, 9] * 10]), "holds the negative token id -7 (at flat index 41)"),
    (np.zeros(0, dtype=np.int64), "has 0 tokens, fewer than train.seq_len + 2 (18)"),
])
def test_npy_arrays_of_the_wrong_shape_or_values(array, expected, tmp_path, shm_dir, capsys, monkeypatch):
    np.save(tmp_path / "tokens.npy", array)
    line = refused_train(tmp_path, capsys, monkeypatch, shm_dir, "data.path=tokens.npy", "train.seq_len=16")
    assert expected in line and "tokens.npy" in line
    assert os.listdir(tmp_path) == ["tokens.npy"] and os.listdir(shm_dir) == []


def test_jsonl_input_ids_given_as_strings(tmp_path, shm_dir, capsys, monkeypatch):
    (tmp_path / "ids.jsonl").write_text('{"input_ids": "1 2 3 4"}\n{"input_ids": [5, 6]}\n')
    line = refused_train(tmp_path, capsys, monkeypatch, shm_dir, "data.path=ids.jsonl", "cluster.ray_address=127.0.0.1:1")
    assert line == ("error: data.path 'ids.jsonl': the first row's input_ids must be a list of integer token ids, "
                    "got '1 2 3 4'.")
    assert os.listdir(tmp_path) == ["ids.jsonl"] and os.listdir(shm_dir) == []


@pytest.mark.parametrize("row,shown", [
    ('{"input_ids": [1.5, 2.0, 3.0]}', "[1.5, 2.0, 3.0]"),
    ('{"input_ids": [[1, 2], [3]]}', "[[1, 2], [3]]"),
    ('{"input_ids": null}', "None"),
])
def test_jsonl_input_ids_that_are_not_integers(row, shown, tmp_path, shm_dir, capsys, monkeypatch):
    (tmp_path / "ids.jsonl").write_text(row + "\n")
    line = refused_train(tmp_path, capsys, monkeypatch, shm_dir, "data.path=ids.jsonl", "cluster.ray_address=127.0.0.1:1")
    assert line == (f"error: data.path 'ids.jsonl': the first row's input_ids must be a list of integer token ids, "
                    f"got {shown}.")
    assert os.listdir(tmp_path) == ["ids.jsonl"] and os.listdir(shm_dir) == []


def test_parquet_input_ids_stored_as_text(tmp_path, shm_dir, capsys, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input_ids": ["1 2 3", "4 5 6"]}), tmp_path / "ids.parquet")
    line = refused_train(tmp_path, capsys, monkeypatch, shm_dir, "data.path=ids.parquet", "cluster.ray_address=127.0.0.1:1")
    assert line == ("error: data.path 'ids.parquet': the first row's input_ids must be a list of integer token ids, "
                    "but the column is string.")
    assert os.listdir(tmp_path) == ["ids.parquet"] and os.listdir(shm_dir) == []


def test_a_garbage_tokenizer_json_is_named_before_the_tokenizer_pool_starts(tmp_path, shm_dir, capsys,
                                                                            monkeypatch):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    (tmp_path / "docs.txt").write_text("One document.\n\nAnother one.\n")
    start = time.monotonic()
    line = refused_train(tmp_path, capsys, monkeypatch, shm_dir, "data.path=docs.txt", "data.format=text",
                  "data.tokenizer=tok", "cluster.ray_address=127.0.0.1:1")  # no Ray may be reached for it
    assert line.startswith(f"error: data.tokenizer '{tmp_path / 'tok'}' is not a loadable Hugging Face tokenizer ")
    assert "\x1b[" not in line and time.monotonic() - start < 30
    assert sorted(os.listdir(tmp_path)) == ["docs.txt", "tok"] and os.listdir(shm_dir) == []  # no data cache
