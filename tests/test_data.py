"""Data through Ray Data: files of every kind, packing, splits, determinism and exact resume.

Every dataset here is a small real file written by the test (jsonl, json, parquet, arrow, txt,
npy) and tokenized by a real Ray Data actor pool, byte-level or with a tokenizer trained here.
"""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

transformers = pytest.importorskip("transformers")

from artifacts import save_tokenizer  # noqa: E402

from megatrain_ray.config import load_config  # noqa: E402
from megatrain_ray.data.builtin import EOS_ID, encode_bytes  # noqa: E402
from megatrain_ray.data.corpus import CorpusSource  # noqa: E402
from megatrain_ray.data.datasets import is_val  # noqa: E402
from megatrain_ray.data.loader import BatchSource, loader_spec, source_from_config  # noqa: E402
from megatrain_ray.errors import ConfigError, DataError  # noqa: E402
from megatrain_ray.model.transformer import IGNORE_INDEX  # noqa: E402

import megatrain_ray.data.corpus  # noqa: E402


def test_loader_label_ignore_value_is_the_models():
    assert megatrain_ray.data.corpus.IGNORE_INDEX == IGNORE_INDEX

QUIET = {"log": lambda line: None}
DOCS = [f"document {i} says " + "word " * (i % 7) + "end" for i in range(60)]


def _cfg(tmp_path, *overrides):
    return load_config(None, [f"data.cache_dir={tmp_path / 'cache'}", *overrides])


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_text_is_tokenized_in_order_eos_separated_split_and_packed(tmp_path, ray_cluster):
    hf = save_tokenizer(tmp_path / "tok", kind="bpe")
    _jsonl(tmp_path / "docs.jsonl", [{"text": d, "id": i} for i, d in enumerate(DOCS)])
    cfg = _cfg(tmp_path, f"data.path={tmp_path / 'docs.jsonl'}", f"data.tokenizer={tmp_path / 'tok'}",
               "data.val_fraction=0.2", "data.num_workers=1", "train.seq_len=8", "train.micro_batch_size=2",
               "train.num_micro_batches=2", f"model.vocab_size={len(hf)}")
    train, val = source_from_config(cfg, **QUIET), source_from_config(cfg, "val", **QUIET)
    held = is_val(np.arange(len(DOCS)), 0.2)
    assert 0 < held.sum() < len(DOCS) // 2

    def stream(docs):
        return np.concatenate([hf(d)["input_ids"] + [hf.eos_token_id] for d in docs])

    np.testing.assert_array_equal(train.tokens, stream([d for d, h in zip(DOCS, held) if not h]))
    np.testing.assert_array_equal(val.tokens, stream([d for d, h in zip(DOCS, held) if h]))
    # One epoch's batches tile the packed stream: each window of 9 tokens once (inputs + last label).
    per_step, n = 4, train.num_samples
    seen = []
    for step in range(n // per_step):
        batch = train.batch(step)
        assert batch["input_ids"].shape == batch["labels"].shape == (2, 2, 8)
        np.testing.assert_array_equal(batch["labels"][..., :-1], batch["input_ids"][..., 1:])
        seen += [tuple(ids) + (labels[-1],) for ids, labels in
                 zip(batch["input_ids"].reshape(-1, 8).tolist(), batch["labels"].reshape(-1, 8).tolist())]
    windows = [tuple(train.tokens[k * 8:k * 8 + 9].tolist()) for k in range(n)]
    assert len(seen) == (n // per_step) * per_step > n - per_step
    remaining = list(windows)
    for w in seen:
        remaining.remove(w)  # each window at most once (raises if seen twice or not a window)
    # Evaluation reads every validation window once, in order.
    windows = np.concatenate([b["input_ids"] for b in val.eval_batches(3)])
    np.testing.assert_array_equal(windows.reshape(-1), val.tokens[:val.num_samples * 8])


def test_corpus_does_not_depend_on_the_pool_size(tmp_path, ray_cluster):
    os.makedirs(tmp_path / "parts")
    for part in range(3):  # several files and row groups: blocks can finish out of order
        table = pa.table({"text": DOCS[part::3]})
        pq.write_table(table, tmp_path / "parts" / f"part-{part}.parquet", row_group_size=5)
    caches = []
    for workers in (1, 2):
        cfg = load_config(None, [f"data.path={tmp_path / 'parts'}", f"data.cache_dir={tmp_path / f'c{workers}'}",
                                 f"data.num_workers={workers}", "train.seq_len=16"])
        caches.append(source_from_config(cfg, **QUIET).ref.path)
    for name in ("train.tokens.bin", "train.offsets.npy"):
        with open(os.path.join(caches[0], name), "rb") as a, open(os.path.join(caches[1], name), "rb") as b:
            assert a.read() == b.read()
    expected = np.concatenate([np.append(encode_bytes(d), EOS_ID) for part in range(3) for d in DOCS[part::3]])
    np.testing.assert_array_equal(np.memmap(os.path.join(caches[0], "train.tokens.bin"), np.int32, "r"), expected)


def test_every_file_kind_and_layout(tmp_path, ray_cluster):
    """alpaca parquet, sharegpt .json array, a .txt directory, .arrow with labels, .npy rows and stream."""
    alpaca = tmp_path / "alpaca.parquet"
    pq.write_table(pa.table({"instruction": ["say hi", "count"], "input": ["", "to 3"], "output": ["hi", "1 2 3"]}),
                   alpaca)
    sharegpt = tmp_path / "chat.json"
    sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": "yo"},
                                                       {"from": "gpt", "value": "hey"}]}]))
    os.makedirs(tmp_path / "txt")
    (tmp_path / "txt" / "a.txt").write_text("first doc\nstill first\n\nsecond doc\n")
    (tmp_path / "txt" / "b.txt").write_text("third doc")
    arrow = tmp_path / "tok.arrow"
    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32()))])
    with pa.ipc.new_file(arrow, schema) as w:  # the layout of a Hugging Face datasets .arrow file
        w.write_table(pa.table({"input_ids": [[5, 6, 7, 8], [9, 10]], "labels": [[-100, -100, 7, 8], [9, 10]]},
                               schema=schema))
    rows = tmp_path / "rows.npy"
    np.save(rows, np.arange(40).reshape(4, 10))
    stream = tmp_path / "stream.npy"
    np.save(stream, np.arange(100) % 50)

    def source(path, *extra, seq=6):
        cfg = _cfg(tmp_path, f"data.path={path}", f"train.seq_len={seq}", "train.micro_batch_size=1",
                   "train.num_micro_batches=1", *extra)
        return source_from_config(cfg, **QUIET)

    s = source(alpaca, seq=48)
    assert s.ref.layout == "rows" and s.num_samples == 2
    first = s.samples(np.array([1]))
    text = bytes(int(t) for t in first["input_ids"][0] if t < 256).decode()
    assert text.startswith("<|user|>\ncount\n\nto 3\n<|assistant|>\n1 2 3")
    targets = bytes(int(t) for t in first["labels"][0] if 0 <= t < 256).decode()
    assert targets == "1 2 3\n"  # the response, its EOS (id 256, not a byte) and the newline

    s = source(sharegpt, seq=30)
    assert s.ref.layout == "rows" and s.num_samples == 1

    s = source(tmp_path / "txt")
    docs = ["first doc\nstill first", "second doc\n", "third doc"]
    np.testing.assert_array_equal(s.tokens, np.concatenate([np.append(encode_bytes(d), EOS_ID) for d in docs]))

    s = source(arrow, "model.vocab_size=64", seq=4)
    assert s.ref.layout == "rows"
    out = s.samples(np.array([0, 1]))
    assert out["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert out["labels"].tolist() == [[IGNORE_INDEX, 7, 8, IGNORE_INDEX], [10] + [IGNORE_INDEX] * 3]

    s = source(rows, "model.vocab_size=64", seq=9)
    assert s.ref.layout == "rows" and s.num_samples == 4
    assert s.samples(np.array([2]))["input_ids"].tolist() == [list(range(20, 29))]

    s = source(stream, "data.format=tokens", "model.vocab_size=64", seq=9)
    assert isinstance(s, CorpusSource) and s.ref.layout == "packed" and s.num_samples == 11
    assert isinstance(source(stream, "model.vocab_size=64"), BatchSource)  # auto: the original windows


def test_resume_restarts_at_the_exact_next_batch(tmp_path, ray_cluster):
    """Loader actors of a first run and of a resumed one (another pool size) agree from the resume step."""
    _jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in DOCS[:20]])
    cfg = _cfg(tmp_path, f"data.path={tmp_path / 'docs.jsonl'}", "train.seq_len=16", "train.micro_batch_size=4",
               "train.num_micro_batches=2", "train.seed=7")
    cls, args = loader_spec(cfg, **QUIET)
    steps = 2 * (CorpusSource(*args).num_samples // 8) + 3  # more than two epochs

    def run(num_loaders, first, last):
        actors = [ray.remote(cls).remote(*args) for _ in range(num_loaders)]
        try:
            return ray.get([actors[s % num_loaders].batch.remote(s) for s in range(first, last)])
        finally:
            for a in actors:
                ray.kill(a)

    uninterrupted = run(2, 0, steps)
    state = CorpusSource(*args).state(next_step=5)  # what a checkpoint after step 4 records
    assert json.loads(json.dumps(state)) == state
    resumed_from = CorpusSource(*args).resume_step(state)
    resumed = run(3, resumed_from, steps)
    assert resumed_from == 5
    for a, b in zip(uninterrupted[5:], resumed):
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
        np.testing.assert_array_equal(a["labels"], b["labels"])
    assert not np.array_equal(uninterrupted[4]["input_ids"], resumed[0]["input_ids"])
    # Epochs are reshuffled, not repeated.
    per_epoch = CorpusSource(*args).num_samples // 8
    assert not np.array_equal(uninterrupted[0]["input_ids"], uninterrupted[per_epoch]["input_ids"])

    other_seed = _cfg(tmp_path, f"data.path={tmp_path / 'docs.jsonl'}", "train.seq_len=16",
                      "train.micro_batch_size=4", "train.num_micro_batches=2", "train.seed=8")
    with pytest.raises(DataError, match="different seed"):
        source_from_config(other_seed, **QUIET).resume_step(state)


def test_original_windows_resume_state(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(500) % 90)
    cfg = load_config(None, [f"data.path={tmp_path / 't.npy'}", "train.seq_len=8", "model.vocab_size=96"])
    a, b = source_from_config(cfg), source_from_config(cfg)
    step = b.resume_step(a.state(3))
    np.testing.assert_array_equal(a.batch(3)["input_ids"], b.batch(step)["input_ids"])


@pytest.mark.parametrize("rows,extra,match", [
    ([{"body": "x"}], [], "columns body, which match no data format"),
    ([{"body": "x"}], ["data.format=text"], "lacks the column\\(s\\) text"),
    ([{"text": "x"}], ["data.format=sharegpt"], "lacks the column\\(s\\) conversations"),
])
def test_unusable_columns_are_named(tmp_path, rows, extra, match):
    _jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=match):
        source_from_config(_cfg(tmp_path, f"data.path={tmp_path / 'd.jsonl'}", *extra), **QUIET)


def test_data_errors_are_one_sentence(tmp_path, ray_cluster):
    os.makedirs(tmp_path / "mixed")
    (tmp_path / "mixed" / "a.txt").write_text("x")
    np.save(tmp_path / "mixed" / "b.npy", np.arange(3))
    with pytest.raises(DataError, match="mixes file kinds \\(npy, txt\\)"):
        source_from_config(_cfg(tmp_path, f"data.path={tmp_path / 'mixed'}"), **QUIET)
    np.save(tmp_path / "big.npy", np.arange(100).reshape(10, 10))
    with pytest.raises(DataError, match="token id 99, outside model.vocab_size \\(96\\)"):
        source_from_config(_cfg(tmp_path, f"data.path={tmp_path / 'big.npy'}", "model.vocab_size=96"), **QUIET)
    np.save(tmp_path / "stream.npy", np.arange(1000) % 90)
    with pytest.raises(DataError, match="no validation split"):
        source_from_config(_cfg(tmp_path, f"data.path={tmp_path / 'stream.npy'}", "model.vocab_size=96"), "val",
                           **QUIET)


@pytest.mark.parametrize("override,named", [
    ("data.format=csv", "data.format must be one of auto, windows"),
    ("data.val_fraction=1.0", "data.val_fraction must be in [0, 1)"),
    ("data.tokenizer=/nonexistent", "data.tokenizer must be a Hugging Face tokenizer directory"),
    ("data.val_path=/nonexistent.jsonl", "data.val_path does not name a readable file or directory"),
])
def test_new_data_keys_are_validated(override, named):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value).startswith(named)


WINDOWS_VAL = ("data.val_fraction must be 0 with data.format windows, whose random windows span the whole stream; "
               "use data.format auto, text or tokens to hold documents out, or data.val_path.")


def test_val_fraction_of_one_stream_holds_part_of_it_out(tmp_path, ray_cluster):
    """format auto + val_fraction on one .txt file or one 1-D .npy stream: documents (text) or the
    stream's tail (tokens) are held out, instead of random windows over all of it."""
    (tmp_path / "book.txt").write_text("\n\n".join(DOCS))
    cfg = _cfg(tmp_path, f"data.path={tmp_path / 'book.txt'}", "data.val_fraction=0.2", "train.seq_len=8")
    train, val = source_from_config(cfg, **QUIET), source_from_config(cfg, "val", **QUIET)
    assert isinstance(train, CorpusSource) and train.ref.layout == "packed"
    held = is_val(np.arange(len(DOCS)), 0.2)

    def stream(docs):
        return np.concatenate([np.append(encode_bytes(d), EOS_ID) for d in docs])

    np.testing.assert_array_equal(train.tokens, stream([d for d, h in zip(DOCS, held) if not h]))
    np.testing.assert_array_equal(val.tokens, stream([d for d, h in zip(DOCS, held) if h]))

    np.save(tmp_path / "stream.npy", np.arange(1000) % 90)
    cfg = _cfg(tmp_path, f"data.path={tmp_path / 'stream.npy'}", "data.val_fraction=0.1", "model.vocab_size=96")
    train, val = source_from_config(cfg, **QUIET), source_from_config(cfg, "val", **QUIET)
    np.testing.assert_array_equal(train.tokens, np.arange(900) % 90)
    np.testing.assert_array_equal(val.tokens, np.arange(900, 1000) % 90)
    # Without val_fraction the same files train as random windows, as before.
    assert isinstance(source_from_config(_cfg(tmp_path, f"data.path={tmp_path / 'book.txt'}"), **QUIET), BatchSource)


def test_windows_with_val_fraction_is_refused_alike_by_plan_train_and_eval(tmp_path, capsys, monkeypatch):
    """One check in the config, so plan, train and eval all refuse it, with the same sentence."""
    from artifacts import save_model

    from megatrain_ray import cli

    (tmp_path / "book.txt").write_text("\n\n".join(DOCS))
    save_model("llama2", tmp_path / "hf", vocab_size=260)
    bad = ["--set", f"data.path={tmp_path / 'book.txt'}", "--set", "data.format=windows",
           "--set", "data.val_fraction=0.1"]
    monkeypatch.chdir(tmp_path)
    for argv in (["plan", *bad], ["train", *bad], ["eval", str(tmp_path / "hf"), *bad]):
        capsys.readouterr()
        assert cli.main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert err.splitlines() == [f"error: {WINDOWS_VAL}"] and out == "", argv
    assert sorted(os.listdir(tmp_path)) == ["book.txt", "hf"]  # refused before any work
