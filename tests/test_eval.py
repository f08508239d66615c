"""``megatrain-ray eval``: held-out loss and perplexity, checked against transformers.

The model runs in this process from the checkpoint's safetensors, one unit at a time; the
reference is the same checkpoint loaded by transformers, with cross-entropy over the same
sequences and the same counted labels.
"""

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from artifacts import dtype_kwarg, save_model, save_tokenizer  # noqa: E402

from megatrain_ray.config import PrecisionSection, load_config  # noqa: E402
from megatrain_ray.engine.store.host_store import ParameterStore, StoreSpec  # noqa: E402
from megatrain_ray.io.evaluate import checkpoint_reader, run_eval  # noqa: E402
from megatrain_ray.io.hf_io import load_train_config  # noqa: E402
from megatrain_ray.model.precision import resolve_precision  # noqa: E402
from megatrain_ray.model.transformer import IGNORE_INDEX  # noqa: E402

LINE = re.compile(r"^eval: val loss ([0-9.]+) \| perplexity ([0-9.]+) \| ([0-9,]+) tokens in ([0-9,]+) sequences")


def _reference_loss(model, ids: np.ndarray, labels: np.ndarray) -> tuple[float, int]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids)).logits.float()
    labels = torch.tensor(labels)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                            reduction="sum")
    return float(total), int((labels != IGNORE_INDEX).sum())


@pytest.mark.parametrize("arch", ["llama2", "qwen2", "qwen3"])
def test_evaluation_loss_through_the_models_forward_equals_transformers(tmp_path, arch):
    """evaluate() runs the model's one whole-model forward (transformer.forward_hidden) over an HF
    directory read unit by unit: its loss must be transformers' on the same weights and tokens
    (untied / tied heads, q/k/v biases, q/k norms), with ignored labels left out.

    Tolerance: both are fp32 over the same math in a different order of operations (HF's attention
    kernel and the logits' reduction); each op adds ~1e-7 relative error and a 2-layer model at these
    widths stays well under 1e-5 relative on a loss of ~4.6, while a wrong norm, bias, rope or head
    moves it by 1e-2 or more."""
    from megatrain_ray.io.evaluate import evaluate

    model = save_model(arch, tmp_path / "hf")
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 96, size=(5, 24))
    labels = np.roll(ids, -1, axis=1)
    labels[:, -1] = IGNORE_INDEX
    labels[1, :7] = IGNORE_INDEX  # a prompt that does not count
    cfg, read = checkpoint_reader(str(tmp_path / "hf"))
    ours = evaluate(cfg, read, [{"input_ids": ids[:3], "labels": labels[:3]}, {"input_ids": ids[3:], "labels": labels[3:]}])
    total, count = _reference_loss(model, ids, labels)
    assert ours.tokens == count == 5 * 23 - 7
    assert ours.loss == pytest.approx(total / count, rel=1e-5)
    assert ours.perplexity == pytest.approx(math.exp(total / count), rel=1e-5)


def test_eval_of_a_run_dir_matches_transformers(tmp_path, shm_dir):
    """A run directory (final/ weights + the run's config.json) evaluated by the CLI in a subprocess."""
    model = save_model("llama3", tmp_path / "hf")
    rng = np.random.default_rng(0)
    np.save(tmp_path / "train.npy", rng.integers(0, 96, 400))
    val = rng.integers(0, 96, 150)
    np.save(tmp_path / "val.npy", val)
    run = tmp_path / "runs" / "r1"
    cfg = load_train_config(None, [f"train.init_from={tmp_path / 'hf'}", f"data.path={tmp_path / 'train.npy'}",
                             f"data.val_path={tmp_path / 'val.npy'}", "train.seq_len=16",
                             f"train.run_dir={tmp_path / 'runs'}", f"memory.shm_dir={shm_dir}"])
    os.makedirs(run)
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    precision = resolve_precision(PrecisionSection(), "cpu")
    store = ParameterStore(StoreSpec(cfg.model, precision, shm_dir, os.getpid(), "ev"), 0, str(tmp_path / "hf"))
    try:
        store.save_hf(str(run / "final"))
    finally:
        store.close()

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "megatrain_ray.cli", "eval", str(run), "--batch-size", "3"],
                          capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr
    match = LINE.match(proc.stdout.strip().splitlines()[-1])
    assert match, proc.stdout
    loss, ppl = float(match.group(1)), float(match.group(2))

    n = (len(val) - 1) // 16  # the val stream tiled into windows of 17 tokens, each once
    windows = np.stack([val[k * 16:k * 16 + 17] for k in range(n)])
    total, count = _reference_loss(model, windows[:, :-1], windows[:, 1:])
    assert int(match.group(3).replace(",", "")) == count == n * 16
    assert int(match.group(4)) == n
    assert loss == pytest.approx(total / count, rel=1e-4)  # printed with 4 decimals
    assert ppl == pytest.approx(math.exp(total / count), rel=1e-3)


def test_eval_of_sft_data_counts_only_responses(tmp_path, ray_cluster):
    """In process, on an HF directory with a tokenizer: chat data, masked labels, exact to 1e-5."""
    # Its own directory: transformers 5 loads a tokenizer that sits next to a config.json as that
    # model family's tokenizer class (Qwen2's would replace this one's pre-tokenizer).
    hf_tok = save_tokenizer(tmp_path / "tok", kind="word")
    model = save_model("qwen2", tmp_path / "hf", vocab_size=len(hf_tok))
    rows = [{"instruction": "what is two plus two?", "output": "it is four."},
            {"instruction": "please write a short poem", "output": "tokens flow like water"},
            {"instruction": "count", "input": "the tokens", "output": "one"}]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = []
    result = run_eval(str(tmp_path / "hf"), None, [f"data.val_path={tmp_path / 'val.jsonl'}", "train.seq_len=24",
                                                   f"data.tokenizer={tmp_path / 'tok'}",
                                                   f"data.cache_dir={tmp_path / 'cache'}"],
                      batch_size=2, log=lines.append)
    cfg, read = checkpoint_reader(str(tmp_path / "hf"))
    assert cfg.tie_word_embeddings and lines[-1].startswith("eval: val loss")

    total, count = 0.0, 0
    for row in rows:  # the hand-made reference: ChatML rendering, CE over response positions only
        prompt = row["instruction"] + ("\n\n" + row["input"] if row.get("input") else "")
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]
        full = hf_tok.apply_chat_template(messages, tokenize=False)
        head = hf_tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
        ids = hf_tok(full, add_special_tokens=False)["input_ids"]
        n_head = len(hf_tok(head, add_special_tokens=False)["input_ids"])
        labels = [IGNORE_INDEX] * (n_head - 1) + ids[n_head:]
        s, c = _reference_loss(model, np.array([ids[:-1]]), np.array([labels]))
        total, count = total + s, count + c
    assert result.tokens == count == 5 + 5 + 2  # "it is four . <|im_end|>", "tokens flow like water <|im_end|>", ...
    assert result.loss == pytest.approx(total / count, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(total / count), rel=1e-5)


def test_eval_without_held_out_data_is_one_sentence(tmp_path):
    save_model("llama2", tmp_path / "hf")
    np.save(tmp_path / "t.npy", np.arange(500) % 96)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "megatrain_ray.cli", "eval", str(tmp_path / "hf"), "--set",
                           f"data.path={tmp_path / 't.npy'}"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: data.path '{tmp_path / 't.npy'}' has no validation split; set data.val_fraction or data.val_path."]


def test_built_in_corpus_holds_out_documents_training_never_sees():
    from megatrain_ray.data.builtin import BUILTIN_VAL_DOCUMENTS, builtin_corpus, builtin_documents

    train_docs, val_docs = builtin_documents("train"), builtin_documents("val")
    assert train_docs == builtin_corpus().split("\n")  # the training corpus is what it always was
    assert len(val_docs) == BUILTIN_VAL_DOCUMENTS and not set(val_docs) & set(train_docs)
    assert val_docs == builtin_documents("val") and all(len(d) > 50 for d in val_docs)


def test_eval_of_the_default_run_reads_the_built_in_held_out_documents(tmp_path, shm_dir, capsys, monkeypatch):
    """`megatrain-ray eval runs/<id>` of a default run (no data settings), checked against transformers
    loading the run's final/ with the byte-level tokenizer written there."""
    from megatrain_ray import cli
    from megatrain_ray.data.builtin import builtin_documents
    from megatrain_ray.data.tokenizer import BYTE_LEVEL

    cfg = load_config(None, [f"train.run_dir={tmp_path / 'runs'}", f"memory.shm_dir={shm_dir}"])
    run = tmp_path / "runs" / "r1"
    os.makedirs(run)
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    precision = resolve_precision(PrecisionSection(), "cpu")
    store = ParameterStore(StoreSpec(cfg.model, precision, shm_dir, os.getpid(), "ev"), 3)
    try:
        store.save_hf(str(run / "final"), tokenizer=BYTE_LEVEL)
    finally:
        store.close()
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert cli.main(["eval", "runs/r1", "--batch-size", "16"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("data: tokenized the built-in corpus's validation documents")
    match = LINE.match(lines[-1])
    assert match, lines

    tok = transformers.AutoTokenizer.from_pretrained(run / "final")
    model = transformers.AutoModelForCausalLM.from_pretrained(run / "final", **dtype_kwarg(torch.float32)).eval()
    stream = np.concatenate([tok(d)["input_ids"] + [tok.eos_token_id] for d in builtin_documents("val")])
    assert tok.eos_token_id == 256 and stream.max() == 256
    s = cfg.train.seq_len
    n = (len(stream) - 1) // s
    windows = np.stack([stream[k * s:k * s + s + 1] for k in range(n)])
    total, count = _reference_loss(model, windows[:, :-1], windows[:, 1:])
    assert int(match.group(3).replace(",", "")) == count and int(match.group(4)) == n
    assert float(match.group(1)) == pytest.approx(total / count, rel=1e-4)


@pytest.mark.slow  # a Ray run with checkpoints, then eval
def test_validation_loss_during_training_is_the_loss_of_the_checkpoint_at_that_step(tmp_path, ray_cluster, shm_dir):
    """train.eval_every: the validation batch rides along the forward of every k-th step; its loss
    is that of the weights the step started from, i.e. of the checkpoint saved at that boundary."""
    from megatrain_ray.data.loader import source_from_config
    from megatrain_ray.io.evaluate import evaluate
    from megatrain_ray.orchestration.pipeline import train

    rng = np.random.default_rng(0)
    np.save(tmp_path / "train.npy", rng.integers(0, 128, 4000))
    np.save(tmp_path / "val.npy", rng.integers(0, 128, 600))
    cfg = load_config(None, [
        "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=128",
        f"data.path={tmp_path / 'train.npy'}", f"data.val_path={tmp_path / 'val.npy'}", "data.num_workers=1",
        "train.seq_len=16", "train.micro_batch_size=2", "train.num_micro_batches=2", "train.steps=3",
        "train.eval_every=2", "train.checkpoint_every=2", "optim.lr=1e-2", "compute.device=cpu",
        f"train.run_dir={tmp_path / 'runs'}", f"memory.shm_dir={shm_dir}"])
    lines = []
    result = train(cfg, log=lines.append)
    assert sorted(result.val_losses) == [0, 2]
    assert any("val loss" in line and "(after 2 updates)" in line for line in lines), lines

    step2 = [c for c in result.checkpoints if c.endswith("step-000002")]
    assert step2, result.checkpoints
    model_cfg, read = checkpoint_reader(step2[0])
    reference = evaluate(model_cfg, read, [source_from_config(cfg, "val").batch(0)]).loss
    assert result.val_losses[2] == pytest.approx(reference, rel=1e-5)
    assert abs(result.val_losses[2] - result.val_losses[0]) > 1e-3  # the weights did change in between
    with open(tmp_path / "runs" / result.run_id / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r.get("val_loss") for r in rows] == [result.val_losses[0], None, result.val_losses[2]]


def test_eval_every_without_validation_data_is_refused(tmp_path):
    from megatrain_ray.errors import ConfigError

    np.save(tmp_path / "t.npy", np.arange(500) % 96)
    with pytest.raises(ConfigError, match=r"^train.eval_every needs validation data: set data.val_fraction"):
        load_config(None, ["train.eval_every=10", f"data.path={tmp_path / 't.npy'}"])
    assert load_config(None, ["train.eval_every=10"]).data.path is None  # the built-in corpus has its own


def test_packed_documents_are_evaluated_each_within_itself(shm_dir):
    """With position_ids (data.pack_documents) evaluation masks attention at document boundaries and
    restarts RoPE per document, as training does: the loss of a pack of two documents is the sum of
    each document's loss alone (fp32; only the summation order differs), and without the positions
    it is not (the second document would attend to the first)."""
    from megatrain_ray.io.evaluate import evaluate, loss_sum, store_reader

    cfg = load_config(None, [f"memory.shm_dir={shm_dir}", "model.num_hidden_layers=2"])
    precision = resolve_precision(PrecisionSection(), "cpu")
    store = ParameterStore(StoreSpec(cfg.model, precision, shm_dir, os.getpid(), "pack"), 5)
    try:
        read, model = store_reader(store.store), cfg.model
        gen = torch.Generator().manual_seed(0)
        docs = [torch.randint(0, model.vocab_size, (n,), generator=gen) for n in (9, 14)]
        labels = [torch.cat([d[1:], torch.tensor([IGNORE_INDEX])]) for d in docs]  # no target across documents
        alone = [loss_sum(model, read, d[None], lab[None]) for d, lab in zip(docs, labels)]
        ids, lab = torch.cat(docs)[None], torch.cat(labels)[None]
        pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
        packed = loss_sum(model, read, ids, lab, position_ids=pos)
        assert packed[1] == sum(n for _, n in alone) == 21
        assert packed[0] == pytest.approx(sum(t for t, _ in alone), rel=1e-5)
        unmasked = loss_sum(model, read, ids, lab)
        assert abs(unmasked[0] - packed[0]) > 1e-3 * packed[0]
        batch = {"input_ids": ids.numpy(), "labels": lab.numpy(), "position_ids": pos.numpy()}
        assert evaluate(model, read, [batch]).loss == pytest.approx(packed[0] / packed[1], rel=1e-6)
    finally:
        store.close()
