"""A bad validation file (data.val_path with train.eval_every) is one sentence naming data.val_path,
given before Ray is reached or any actor starts, like bad training data (issue 14).

Every case runs ``megatrain-ray train`` with ``cluster.ray_address=127.0.0.1:1``, an address where no
Ray answers: reaching for Ray would end in a different error. Nothing may be left behind: no run
directory, no data cache, no shared-memory segment.
"""

import os

import numpy as np
import pytest

from test_bad_input import _run

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
    line = _run(["train", "--set", "train.eval_every=2", "--set", f"data.val_path={name}",
                 "--set", "cluster.ray_address=127.0.0.1:1", "--set", f"memory.shm_dir={shm_dir}"],
                tmp_path, capsys, monkeypatch)
    assert "data.val_path" in line and "Ray" not in line, line
    assert line == expected if expected.startswith("error: ") else line.endswith(expected), line
    assert sorted(os.listdir(tmp_path)) == before  # no runs/, no data cache
    assert os.listdir(shm_dir) == []
