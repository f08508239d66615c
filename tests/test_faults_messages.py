"""What a user reads when the data, a checkpoint or a path is not what it should be: one sentence
naming the file and line (or row, key, directory), given before anything is lost, with no
traceback of Ray Data or Ray on the terminal. Real files, the real command line (``cli.main`` in
this process, or a subprocess where the terminal itself is checked).
"""

import json
import os
import re
import subprocess
import sys

import pytest

from megatrain_ray.config import load_config
from megatrain_ray.data.loader import source_from_config
from megatrain_ray.engine.store.host_store import ParameterStore, StoreSpec
from megatrain_ray.errors import DataError
from megatrain_ray.io import checkpoint, writer
from megatrain_ray.io.resume import find
from megatrain_ray.model.precision import Precision
from refusals import hf_dir, refused, snapshot  # noqa: F401  (hf_dir: a fixture)

transformers = pytest.importorskip("transformers")


def _jsonl(path, rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def _data_cfg(tmp_path, *extra):
    return load_config(None, [f"data.cache_dir={tmp_path / 'cache'}", *extra])


# ---------------------------------------------------------------------------------------------
# Data rows.

@pytest.mark.slow  # a private Ray in a subprocess, to see exactly what reaches the terminal
def test_a_broken_jsonl_line_is_named_by_its_line_without_a_ray_data_traceback(tmp_path):
    rows = [{"text": f"document number {i} with a few words in it"} for i in range(10_000)]
    rows[5000] = '{"text": "a broken line" "missing a comma"}'
    _jsonl(tmp_path / "docs.jsonl", rows)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "megatrain_ray.cli", "train", "--set", "data.path=docs.jsonl",
                           "--set", "data.format=text", "--set", "cluster.ray_address=local"], cwd=tmp_path,
                          env={**env, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: data.path 'docs.jsonl' line 5001 is not valid JSON (Expecting ',' delimiter).")
    terminal = proc.stdout + proc.stderr
    assert "Traceback" not in terminal and "ray.data" not in terminal, terminal[-3000:]
    assert not list(tmp_path.glob("runs/*/config.json"))  # refused before a run directory
    assert not list(tmp_path.glob("runs/data-cache/*"))  # no cache, not even a temporary one


@pytest.mark.parametrize("fmt,row,named", [
    ("alpaca", {"instruction": None, "input": "", "output": "fine"},
     "an alpaca row needs text in instruction and output, but its instruction is null."),
    ("alpaca", {"input": "x", "output": 3},
     "an alpaca row needs text in instruction and output, but its instruction is missing and its output is a "
     "number."),
    ("sharegpt", {"conversations": "human: hi, gpt: hello"},
     "a sharegpt row needs 'conversations' as a non-empty list of turns, but its conversations is a string."),
    ("sharegpt", {"conversations": []},
     "a sharegpt row needs 'conversations' as a non-empty list of turns, but its conversations is an empty list."),
])
def test_a_malformed_chat_row_is_named_by_its_line(fmt, row, named, tmp_path, ray_cluster):
    good = ({"instruction": "say hi", "input": "", "output": "hi"} if fmt == "alpaca" else
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]})
    _jsonl(tmp_path / "chat.jsonl", [good, good, row, good])
    cfg = _data_cfg(tmp_path, f"data.path={tmp_path / 'chat.jsonl'}", f"data.format={fmt}")
    with pytest.raises(DataError) as info:
        source_from_config(cfg, log=lambda line: None)
    assert str(info.value) == f"data.path '{tmp_path / 'chat.jsonl'}' line 3: {named}"
    assert not list((tmp_path / "cache").glob("*/meta.json"))


def _arrow(path, rows, chunk=100) -> None:
    """An Arrow IPC file of ``rows`` in record batches of ``chunk`` rows."""
    import pyarrow as pa

    table = pa.Table.from_pylist(rows)
    with pa.ipc.new_file(str(path), table.schema) as w:
        for batch in table.to_batches(max_chunksize=chunk):
            w.write_batch(batch)


@pytest.mark.parametrize("fmt,rows,bad,named", [
    ("tokens", [{"input_ids": list(range(1, 40))}] * 300, {"input_ids": [1, 2, -5, 4]},
     "input_ids must be non-negative 32-bit token ids, got -5..4."),
    ("alpaca", [{"instruction": "say hi", "input": "", "output": "hi"}] * 300,
     {"instruction": "say hi", "input": "", "output": None},
     "an alpaca row needs text in instruction and output, but its output is null."),
])
def test_a_bad_arrow_row_is_named_by_its_row(fmt, rows, bad, named, tmp_path):
    """An .arrow file (read batch by batch in this process, no Ray Data): the row refused is named by
    its number across record batches, as a .jsonl file's line is; one file of several, by its name too."""
    rows = list(rows)
    rows[237] = bad  # in the third record batch
    _arrow(tmp_path / "rows.arrow", rows)
    cfg = _data_cfg(tmp_path, f"data.path={tmp_path / 'rows.arrow'}", f"data.format={fmt}")
    with pytest.raises(DataError) as info:
        source_from_config(cfg, log=lambda line: None)
    assert str(info.value) == f"data.path '{tmp_path / 'rows.arrow'}' row 238: {named}"
    (tmp_path / "dir").mkdir()
    _arrow(tmp_path / "dir" / "a.arrow", rows[:1])
    os.replace(tmp_path / "rows.arrow", tmp_path / "dir" / "b.arrow")
    cfg = _data_cfg(tmp_path, f"data.path={tmp_path / 'dir'}", f"data.format={fmt}")
    with pytest.raises(DataError) as info:
        source_from_config(cfg, log=lambda line: None)
    assert str(info.value) == f"data.path '{tmp_path / 'dir'}': 'b.arrow' row 238: {named}"
    assert not list((tmp_path / "cache").glob("*/meta.json")) and not list((tmp_path / "cache").glob("*.tmp-*"))


def test_an_arrow_file_of_text_rows_is_tokenized(tmp_path):
    """.arrow rows of text are tokenized (not taken for token rows): the corpus holds the documents'
    bytes (the byte-level tokenizer), each once."""
    _arrow(tmp_path / "text.arrow", [{"text": f"document {i} of the arrow file"} for i in range(250)])
    lines = []
    source = source_from_config(_data_cfg(tmp_path, f"data.path={tmp_path / 'text.arrow'}", "data.format=text"),
                                log=lines.append)
    (tokenized,) = [line for line in lines if line.startswith("data: tokenized")]
    counts = re.search(r"\(([\d,]+) train tokens, ([\d,]+) val tokens\)", tokenized)
    assert source is not None and counts, tokenized
    # every document's bytes and its EOS, in the train or the validation split
    assert sum(int(c.replace(",", "")) for c in counts.groups()) == sum(
        len(f"document {i} of the arrow file".encode()) + 1 for i in range(250))


def test_an_empty_text_file_is_named_at_once(tmp_path, shm_dir, capsys, monkeypatch):
    (tmp_path / "empty.txt").write_text("\n  \n")
    line = refused(["train", "--set", f"memory.shm_dir={shm_dir}", "--set", "data.path=empty.txt",
                 "--set", "data.format=text", "--set", "cluster.ray_address=127.0.0.1:1"], tmp_path, capsys,
                monkeypatch)  # no Ray may be reached for it
    assert line == ("error: data.path 'empty.txt' is empty: there is no text to train on; point data.path at the "
                    "text meant.")
    assert os.listdir(tmp_path) == ["empty.txt"]


def test_a_tokenizer_larger_than_the_vocabulary_is_named_before_tokenizing(hf_dir, tmp_path, shm_dir, capsys,  # noqa: F811
                                                                          monkeypatch):
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=__import__("tokenizers").Tokenizer(__import__("tokenizers").models.WordLevel(
            {f"w{i}": i for i in range(400)}, unk_token="w0")), eos_token="w1")
    tok.save_pretrained(tmp_path / "tok")
    (tmp_path / "docs.txt").write_text("w3 w4\n\nw5 w6\n")
    line = refused(["train", "--set", f"memory.shm_dir={shm_dir}", "--set", "data.path=docs.txt", "--set",
                 "data.format=text", "--set", "data.tokenizer=tok", "--set", "cluster.ray_address=127.0.0.1:1"],
                tmp_path, capsys, monkeypatch)
    assert line == (f"error: data.tokenizer '{tmp_path / 'tok'}' has 400 tokens, more than model.vocab_size (260); "
                    "use the model's own tokenizer, or a model whose vocabulary holds at least 400 tokens.")
    assert sorted(os.listdir(tmp_path)) == ["docs.txt", "tok"]


# ---------------------------------------------------------------------------------------------
# Paths.

def test_a_directory_given_as_the_config_file(tmp_path, capsys, monkeypatch):
    line = refused(["train", "--config", "."], tmp_path, capsys, monkeypatch)
    assert line == "error: config file '.' is a directory; pass a YAML file (e.g. configs/tiny.yaml)."


@pytest.fixture(scope="module")
def run_with_two(tmp_path_factory):
    """A run directory (in a folder of runs) holding two real checkpoints, steps 2 and 4."""
    import torch

    base = tmp_path_factory.mktemp("two")
    (base / "shm").mkdir()
    cfg = load_config(None, [f"memory.shm_dir={base / 'shm'}", f"train.run_dir={base / 'runs'}", "train.steps=6",
                             "compute.device=cpu"])
    ps = ParameterStore(StoreSpec(cfg.model, Precision(torch.float32, torch.float32), str(base / "shm"), os.getpid(),
                                  "two"), 0)
    run = base / "runs" / "20260101-000000-aaaaaa"
    try:
        data = {k: v for k, v in source_from_config(cfg).state(0).items() if k != "next_step"}
        for step in (2, 4):
            for i in range(len(ps.store.layout.units)):
                ps.store.set_version(i, step)
            writer.save(ps.store, str(run / "checkpoints"), step, cfg.to_dict(), "two", data)
    finally:
        ps.close()
    return run


def _copy(run, tmp_path):
    import shutil

    dst = tmp_path / "runs" / run.name
    shutil.copytree(run, dst)
    return dst


def test_a_resume_continues_in_place_only_from_its_runs_newest_checkpoint(run_with_two, tmp_path):
    """--resume RUN continues RUN where it lies (whatever directory the command runs in); an older
    checkpoint of it, or another train.run_dir, writes a run directory of its own, and says why."""
    from megatrain_ray.io.resume import continued_run, resume_config

    run = _copy(run_with_two, tmp_path)
    (run / "config.json").write_text("{}")  # what makes it a run directory (a run writes its config there first)
    step2, step4 = (str(run / "checkpoints" / f"step-00000{s}") for s in (2, 4))
    cfg, directory, _ = resume_config(str(run), None, [])
    assert directory == step4 and cfg.train.run_dir == str(run.parent)  # the copy's folder, not the config's
    assert continued_run(directory, cfg.train.run_dir) == (str(run), "")
    where, why = continued_run(step2, cfg.train.run_dir)
    assert where is None and f"{run} has checkpoints after it (step-000004), which stay as they are" in why
    cfg, directory, _ = resume_config(str(run), None, [f"train.run_dir={tmp_path / 'elsewhere'}"])
    assert cfg.train.run_dir == str(tmp_path / "elsewhere")
    assert continued_run(directory, cfg.train.run_dir) == (
        None, f"train.run_dir ({tmp_path / 'elsewhere'}) is not the folder that holds {run}")


def test_the_folder_of_runs_given_to_resume(run_with_two, tmp_path, capsys, monkeypatch):
    run = _copy(run_with_two, tmp_path)
    line = refused(["train", "--resume", "runs"], tmp_path, capsys, monkeypatch)
    assert line == f"error: --resume 'runs' is a folder of runs, not one run; pass one of them, e.g. the newest: " \
                   f"--resume runs/{run.name}."


@pytest.mark.parametrize("change", [
    lambda text: text.replace('"step": 4', '"step": 5'),  # one bit: 0x34 -> 0x35
    lambda text: text.replace('"step":', '"stop":'),  # a garbled key
])
def test_a_changed_meta_json_is_corrupt_and_resume_falls_back(change, run_with_two, tmp_path, capsys, monkeypatch):
    run = _copy(run_with_two, tmp_path)
    meta = run / "checkpoints" / "step-000004" / "meta.json"
    text = meta.read_text()
    assert change(text) != text
    meta.write_text(change(text))
    before = snapshot(run)
    lines = []
    assert find(str(run), lines.append) == str(run / "checkpoints" / "step-000002")
    assert lines == [f"resume: skipped the corrupt checkpoint {run / 'checkpoints' / 'step-000004'} (its meta.json "
                     "does not match its checksum (its content changed after it was written)); using "
                     f"{run / 'checkpoints' / 'step-000002'}, the newest valid one"]
    assert checkpoint.latest(str(run / "checkpoints")) == str(run / "checkpoints" / "step-000002")  # restarts too
    line = refused(["train", "--resume", run / "checkpoints" / "step-000004"], tmp_path, capsys, monkeypatch)
    assert line == (f"error: checkpoint {run / 'checkpoints' / 'step-000004'} cannot be read: its meta.json does not "
                    "match its checksum (its content changed after it was written).")
    assert snapshot(run) == before


def test_a_checkpoint_directory_replaced_by_a_file_is_named(run_with_two, tmp_path):
    import shutil

    run = _copy(run_with_two, tmp_path)
    shutil.rmtree(run / "checkpoints" / "step-000004")
    (run / "checkpoints" / "step-000004").write_text("not a checkpoint")
    lines = []
    assert find(str(run), lines.append) == str(run / "checkpoints" / "step-000002")
    assert lines == [f"resume: passed over {run / 'checkpoints' / 'step-000004'}, which is a file, not a checkpoint "
                     "directory"]


def test_export_of_a_checkpoint_without_meta_json_is_refused(run_with_two, tmp_path, capsys, monkeypatch):
    run = _copy(run_with_two, tmp_path)
    step = run / "checkpoints" / "step-000004"
    (step / "meta.json").unlink()
    line = refused(["export", step, "--out", tmp_path / "out"], tmp_path, capsys, monkeypatch)
    assert line == (f"error: checkpoint {step} has no meta.json, so it is incomplete or damaged and its weights "
                    "cannot be verified; use another checkpoint of the run, or its final/.")
    assert not (tmp_path / "out").exists()


def test_resume_with_another_init_from_names_init_from(hf_dir, tmp_path, capsys, monkeypatch):  # noqa: F811
    import torch

    from megatrain_ray.io.hf_io import load_train_config

    cfg = load_train_config(None, [f"memory.shm_dir={tmp_path}", f"train.init_from={hf_dir}", "train.steps=4"])
    ps = ParameterStore(StoreSpec(cfg.model, Precision(torch.float32, torch.float32), str(tmp_path), os.getpid(),
                                  "init"), 0)
    try:
        for i in range(len(ps.store.layout.units)):
            ps.store.set_version(i, 2)
        ckpt = writer.save(ps.store, str(tmp_path / "run" / "checkpoints"), 2, cfg.to_dict(), "init", {})
    finally:
        ps.close()
    other = tmp_path / "other"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128)).save_pretrained(other)
    line = refused(["train", "--resume", ckpt, "--set", f"train.init_from={other}"], tmp_path, capsys, monkeypatch)
    assert "model.model_type" not in line
    assert line.startswith(f"error: checkpoint {ckpt} holds a different model than the run's config ("), line
    assert "hidden_size 32 vs 64" in line
    assert line.endswith("resume without changing model.* or train.init_from, or start a new run from its weights "
                         f"with train.init_from={ckpt}.")


@pytest.mark.slow  # a private Ray in a subprocess
def test_the_ray_log_directory_named_honours_ray_tmpdir():
    import shutil
    import tempfile

    from pathlib import Path

    tmp_path = Path(tempfile.mkdtemp(prefix="mt-rt-", dir="/tmp"))  # short: Ray's socket paths live under it
    try:
        _logs_under(tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _logs_under(tmp_path):
    code = ("import ray\nray.init(num_cpus=1, include_dashboard=False)\n"
            "from megatrain_ray.orchestration.calls import ray_logs\nprint(ray_logs())\nray.shutdown()\n")
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_TMPDIR": str(tmp_path / "raytmp"),
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = proc.stdout.strip().splitlines()[-1]
    assert logs.startswith(str(tmp_path / "raytmp")) and logs.endswith("/logs") and os.path.isdir(logs), proc.stdout
    proc = subprocess.run([sys.executable, "-c", "from megatrain_ray.orchestration.calls import ray_logs\n"
                           "print(ray_logs())"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip() == str(tmp_path / "raytmp" / "ray" / "session_latest" / "logs")  # no Ray: the newest
