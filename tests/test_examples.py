"""The example files of configs/examples, which let the configs run as written without the Hugging
Face Hub: they are what configs/examples/make_examples.py builds (a byte-level BPE trained with the
``tokenizers`` library on the built-in corpus, alpaca rows of the same grammar, a tiny Qwen2 stand-in
for a pretrained model), and every config plans as written, no path to replace: the small ones on
this CPU, the 7.6 B ones for an H200 box. The long-context ones read the built-in corpus's long
documents (data.builtin_document_tokens), checked here at a cut-down length: every document fills a
sequence. (The runs themselves: tests/test_configs.py.)"""

import importlib.util
import json
import os
import re

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain_ray import cli  # noqa: E402
from megatrain_ray.data.builtin import BUILTIN_LONG_DOCUMENTS, BUILTIN_LONG_VAL_DOCUMENTS  # noqa: E402
from megatrain_ray.data.datasets import dataset_spec, fingerprint  # noqa: E402
from megatrain_ray.data.loader import source_from_config  # noqa: E402
from megatrain_ray.errors import ConfigError  # noqa: E402
from megatrain_ray.io.hf_io import load_train_config  # noqa: E402
from megatrain_ray.orchestration import preflight  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "configs", "examples")
CONFIGS = sorted(n[:-5] for n in os.listdir(os.path.join(ROOT, "configs")) if n.endswith(".yaml"))
BIG = {"qwen2.5-7b", "long-context", "long-context-512k"}
"""The configs sized for an H200 box (planned for one: their /dev/shm need is more than most CPUs have)."""
H200 = ["--device", "cuda", "--gpu-memory", "141", "--host-memory", "120"]


def _maker():
    spec = importlib.util.spec_from_file_location("make_examples", os.path.join(EXAMPLES, "make_examples.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_examples_are_what_the_script_builds(tmp_path):
    make = _maker()
    hf = make.build_tokenizer(str(tmp_path / "tokenizer"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "tokenizer" / name).read_text() == open(os.path.join(EXAMPLES, "tokenizer", name)).read()
    assert json.load(open(os.path.join(EXAMPLES, "alpaca.json"))) == make.alpaca_rows()
    committed = transformers.AutoTokenizer.from_pretrained(os.path.join(EXAMPLES, "tokenizer"))
    assert len(committed) == len(hf) == make.VOCAB and committed.eos_token == "<|endoftext|>"
    ids = committed.apply_chat_template([{"role": "user", "content": "The optimizer updates the loss."}],
                                        add_generation_prompt=True)
    assert committed.decode(ids) == "<|im_start|>user\nThe optimizer updates the loss.<|im_end|>\n<|im_start|>assistant\n"
    model = json.load(open(os.path.join(EXAMPLES, "model", "config.json")))
    assert model["vocab_size"] == len(hf) and model["eos_token_id"] == committed.eos_token_id
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(EXAMPLES) for f in fs)
    assert size < 300_000  # what is committed stays small
    make.build_gpt_oss(str(tmp_path / "gpt-oss"), len(hf))
    from safetensors.torch import load_file

    built, committed_oss = (load_file(os.path.join(d, "gpt-oss", "model.safetensors")) for d in (tmp_path, EXAMPLES))
    assert built.keys() == committed_oss.keys() and all(torch.equal(built[k], committed_oss[k]) for k in built)
    assert any(k.endswith("gate_up_proj_blocks") for k in built)  # the experts as the Hub holds gpt-oss's: MXFP4
    # the config as transformers reads it (a newer transformers may add fields with their defaults)
    built_config, committed_config = (transformers.GptOssConfig.from_json_file(os.path.join(d, "gpt-oss", "config.json"))
                                      for d in (tmp_path, EXAMPLES))
    assert built_config.to_dict() == committed_config.to_dict()
    assert "transformers_version" not in json.load(open(os.path.join(EXAMPLES, "gpt-oss", "config.json")))


def test_every_config_is_checked():
    assert len(CONFIGS) == 9 and BIG < set(CONFIGS)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("where", ["repository", "elsewhere"])
def test_the_config_plans_as_written(name, where, capsys, monkeypatch, tmp_path):
    """From the repository (as the README runs them) and from another directory: the example paths
    are read beside the config file, where the current directory has nothing of that name."""
    monkeypatch.chdir(ROOT if where == "repository" else tmp_path)
    path = os.path.relpath(os.path.join(ROOT, "configs", f"{name}.yaml"))
    cfg = load_train_config(path)
    for value in (cfg.data.path, cfg.data.tokenizer, cfg.train.init_from):
        assert value is None or value.startswith(EXAMPLES + os.sep), value
    text = open(path).read()
    assert "huggingface-cli" not in text and "REPLACE" not in text and "/path/to" not in text
    capsys.readouterr()
    status = cli.main(["plan", "--config", path, *(H200 if name in BIG else ["--device", "cpu"])])
    out, err = capsys.readouterr()
    if cfg.data.builtin_document_tokens:  # the loaders' token stream, counted at the long documents' length
        stream = (BUILTIN_LONG_DOCUMENTS + BUILTIN_LONG_VAL_DOCUMENTS) * cfg.data.builtin_document_tokens * 8
        assert re.search(rf"^token stream x {cfg.data.num_workers} loader\(s\)\s+host RAM\s+"
                         rf"{re.escape(preflight.fmt(stream * cfg.data.num_workers))}$", out, re.M), out
    if name in BIG:  # this machine's /dev/shm (or RAM) may be short of the H200 box's: nothing else
        assert status == 0 or re.fullmatch(r"error: the run needs [0-9.]+ GiB (in memory.shm_dir|of host RAM)"
                                           r"( \([^)]*\))? but only .*\n", err), err
    else:
        assert status == 0, err


@pytest.mark.parametrize("name", ["long-context", "long-context-512k"])
def test_the_long_context_data_fills_each_sequence(name, tmp_path, monkeypatch):
    """The config's data as written, at a cut-down length (2,048 tokens for its sequence and its
    documents): 8 documents (and 1 held out) of the example tokenizer's ids, each longer than a
    sequence, so each sequence lies within one or two documents; the batches have the configured shape."""
    monkeypatch.chdir(ROOT)
    cfg = load_train_config(os.path.join("configs", f"{name}.yaml"), [
        "train.seq_len=2048", "data.builtin_document_tokens=2048", f"train.run_dir={tmp_path}"])
    written = load_train_config(os.path.join("configs", f"{name}.yaml"))
    assert written.data.builtin_document_tokens == written.train.seq_len and written.data.path is None
    lines = []
    train = source_from_config(cfg, log=lines.append)
    assert len(train.lengths) == BUILTIN_LONG_DOCUMENTS and min(train.lengths) > 2048  # text, then EOS
    assert max(train.lengths) < 2048 * 1.1  # generated to the length asked, not far past it
    assert any("generating and tokenizing the built-in corpus's long documents (2,048+ tokens each)" in ln
               for ln in lines), lines
    eos = train.tokens[train.starts[1:] - 1]
    assert (eos == 0).all() and (np.asarray(train.tokens) != 0).sum() == len(train.tokens) - BUILTIN_LONG_DOCUMENTS
    batch = train.batch(0)
    assert batch["input_ids"].shape == batch["labels"].shape == (1, 1, 2048)
    assert (batch["input_ids"] == 0).sum() <= 1  # one document boundary at most in a sequence
    assert 0 <= batch["input_ids"].min() and batch["input_ids"].max() < 384  # the example tokenizer's ids
    assert train.num_samples >= BUILTIN_LONG_DOCUMENTS
    val = source_from_config(cfg, "val")
    assert len(val.lengths) == BUILTIN_LONG_VAL_DOCUMENTS and val.lengths[0] > 2048
    assert next(val.eval_batches(4))["input_ids"].shape == (1, 2048)
    # deterministic: the same setting finds its cache; another length is another corpus
    again = source_from_config(cfg)
    assert again.ref.path == train.ref.path and np.array_equal(again.tokens, train.tokens)
    longer = load_train_config(os.path.join("configs", f"{name}.yaml"), [
        "data.builtin_document_tokens=2049", f"train.run_dir={tmp_path}"])
    assert fingerprint(dataset_spec(longer.data, None, None)) != fingerprint(dataset_spec(cfg.data, None, None))


def test_your_own_data_replaces_the_long_documents(tmp_path, monkeypatch):
    """``--set data.path=...`` as the config's comment writes it: the user's files are read, and
    data.builtin_document_tokens (about the built-in corpus only) changes nothing."""
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "a.txt").write_text("One long book.\n\nIts second chapter.")
    cfg = load_train_config(os.path.join(ROOT, "configs", "long-context.yaml"), [f"data.path={tmp_path / 'books'}"])
    p = dataset_spec(cfg.data, None, cfg.data.path)
    assert (p.kind, p.format, p.document_tokens) == ("txt", "text", 0)
    assert p.where == f"data.path {str(tmp_path / 'books')!r}"


def test_a_path_is_read_from_the_current_directory_first_then_beside_the_config(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "run.yaml").write_text("data: {path: corpus.txt, format: text}\n")
    (tmp_path / "conf" / "corpus.txt").write_text("beside the config")
    monkeypatch.chdir(tmp_path)
    assert load_train_config("conf/run.yaml").data.path == str(tmp_path / "conf" / "corpus.txt")
    (tmp_path / "corpus.txt").write_text("in the current directory")
    assert load_train_config("conf/run.yaml").data.path == "corpus.txt"  # as written
    (tmp_path / "corpus.txt").unlink()
    (tmp_path / "conf" / "corpus.txt").unlink()
    with pytest.raises(ConfigError, match=re.escape("data.path does not name a readable file or directory: "
                                                    "'corpus.txt'")):
        load_train_config("conf/run.yaml")  # nowhere: refused as written
    assert load_train_config("conf/run.yaml", ["data.path=null"]).data.path is None  # --set is taken as given


@pytest.mark.parametrize("setting,message", [
    (["data.builtin_document_tokens=-1"], "data.builtin_document_tokens must be 0 or positive, got -1"),
    (["data.builtin_document_tokens=64", "data.format=windows"],
     "data.builtin_document_tokens makes the built-in corpus long documents of text, which data.format windows"),
])
def test_long_documents_are_refused_where_they_cannot_be(setting, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_train_config(None, setting)


TINY = ["model.hidden_size=64", "model.intermediate_size=176", "model.num_hidden_layers=2",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=512",
        "memory.mlp_chunk_size=512", "memory.loss_chunk_size=512"]
"""A tiny shape of the 7.6 B configs, for the CPU (the vocabulary still holds the example tokenizer's)."""


@pytest.mark.slow  # a Ray run that tokenizes the long documents first
@pytest.mark.parametrize("name", ["long-context", "long-context-512k"])
def test_a_long_context_config_trains_as_written_at_a_tiny_shape(name, tmp_path, ray_cluster, shm_dir):
    """Its data and tokenizer as written (the long documents cut down to 2,048 tokens, the sequence
    too), the model made tiny: two steps train on the CPU, each to a finite loss."""
    from megatrain_ray.orchestration.pipeline import train

    cfg = load_train_config(os.path.join(ROOT, "configs", f"{name}.yaml"), [
        *TINY, "train.seq_len=2048", "data.builtin_document_tokens=2048", "model.max_position_embeddings=2048",
        "train.steps=2", "optim.warmup_steps=0", "train.checkpoint_every=0", "train.save_final=false",
        "compute.device=cpu", "data.num_workers=1", "cluster.actor_timeout_s=300", f"train.run_dir={tmp_path}",
        f"memory.shm_dir={shm_dir}"])
    lines = []
    result = train(cfg, log=lines.append)
    assert len(result.losses) == 2 and all(np.isfinite(result.losses)), lines
    assert any("generating and tokenizing the built-in corpus's long documents" in ln for ln in lines), lines
