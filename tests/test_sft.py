"""Chat SFT: alpaca and sharegpt rows, the tokenizer's chat template, loss only on response tokens.

The expectations are written out by hand: token ids from the (locally trained) word-level
vocabulary, and which positions count. The end-to-end test trains one step through the real
pipeline (Ray Data tokenizer pool, loader actors) and checks the loss against cross-entropy computed
by hand over the response positions only, with transformers' logits.
"""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from artifacts import save_model, save_tokenizer  # noqa: E402

from megatrain_ray.config import load_config  # noqa: E402
from megatrain_ray.data.builtin import EOS_ID, encode_bytes  # noqa: E402
from megatrain_ray.data.corpus import CorpusSource  # noqa: E402
from megatrain_ray.data.loader import source_from_config  # noqa: E402
from megatrain_ray.data.tokenizer import ByteTokenizer, HFTokenizer, messages_from_row  # noqa: E402
from megatrain_ray.errors import DataError  # noqa: E402
from megatrain_ray.io.hf_io import load_train_config  # noqa: E402
from megatrain_ray.model.transformer import IGNORE_INDEX  # noqa: E402

QUESTION = {"instruction": "what is two plus two?", "input": "", "output": "it is four."}


@pytest.fixture(scope="module")
def word_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "word"
    return str(path), save_tokenizer(path, kind="word")


def _ids(hf, words):
    return [hf.convert_tokens_to_ids(w) for w in words]


def test_alpaca_chatml_hand_built(word_tok):
    path, hf = word_tok
    ids, mask = HFTokenizer(path).encode_chat(messages_from_row(QUESTION, "alpaca"))
    prompt = ["<|im_start|>", "user", "what", "is", "two", "plus", "two", "?", "<|im_end|>",
              "<|im_start|>", "assistant"]
    response = ["it", "is", "four", ".", "<|im_end|>"]
    assert ids.tolist() == _ids(hf, prompt + response)
    assert mask.tolist() == [0] * len(prompt) + [1] * len(response)


def test_sharegpt_multi_turn_masks_every_response_and_nothing_else(word_tok):
    path, hf = word_tok
    row = {"conversations": [
        {"from": "system", "value": "please write"},
        {"from": "human", "value": "what is two plus two?"},
        {"from": "gpt", "value": "it is four."},
        {"from": "human", "value": "write a short poem"},
        {"from": "gpt", "value": "tokens flow like water"},
    ]}
    ids, mask = HFTokenizer(path).encode_chat(messages_from_row(row, "sharegpt"))
    s, e = "<|im_start|>", "<|im_end|>"
    pieces = [([s, "system", "please", "write", e], 0),
              ([s, "user", "what", "is", "two", "plus", "two", "?", e], 0),
              ([s, "assistant"], 0), (["it", "is", "four", ".", e], 1),
              ([s, "user", "write", "a", "short", "poem", e], 0),
              ([s, "assistant"], 0), (["tokens", "flow", "like", "water", e], 1)]
    assert ids.tolist() == _ids(hf, [w for words, _ in pieces for w in words])
    assert mask.tolist() == [m for words, m in pieces for _ in words]


def test_byte_level_default_template_hand_built():
    row = {"instruction": "Add", "input": "1+1", "output": "2", "system": "Be brief"}
    ids, mask = ByteTokenizer().encode_chat(messages_from_row(row, "alpaca"))
    prompt = encode_bytes("<|system|>\nBe brief\n<|user|>\nAdd\n\n1+1\n<|assistant|>\n").tolist()
    response = [ord("2"), EOS_ID, ord("\n")]
    assert ids.tolist() == prompt + response
    assert mask.tolist() == [0] * len(prompt) + [1] * 3


def test_labels_are_next_response_tokens_and_padding_is_ignored(word_tok, tmp_path, ray_cluster):
    path, hf = word_tok
    (tmp_path / "sft.jsonl").write_text(json.dumps(QUESTION) + "\n")
    cfg = load_config(None, [f"data.path={tmp_path / 'sft.jsonl'}", f"data.tokenizer={path}",
                             f"data.cache_dir={tmp_path / 'cache'}", "train.seq_len=20",
                             "train.micro_batch_size=1", "train.num_micro_batches=1", f"model.vocab_size={len(hf)}"])
    source = source_from_config(cfg, log=lambda line: None)
    assert isinstance(source, CorpusSource) and source.ref.layout == "rows"
    batch = source.batch(0)
    full = _ids(hf, ["<|im_start|>", "user", "what", "is", "two", "plus", "two", "?", "<|im_end|>",
                     "<|im_start|>", "assistant", "it", "is", "four", ".", "<|im_end|>"])
    pad = hf.pad_token_id
    assert batch["input_ids"][0, 0].tolist() == full + [pad] * (20 - len(full))
    # Position p predicts token p + 1: counted only when that token is part of the response.
    expected = [IGNORE_INDEX] * 10 + full[11:] + [IGNORE_INDEX] * (20 - 15)
    assert batch["labels"][0, 0].tolist() == expected


def test_one_pipeline_step_counts_only_response_tokens(word_tok, tmp_path, ray_cluster, shm_dir):
    """The pipeline's loss on an SFT batch equals hand-computed CE over the 5 response positions.

    Through the single-process driver (the engine's roles without the actor wiring: the masking is
    the data's and the compute worker's); the data is still tokenized by the Ray Data pool."""
    path, hf = word_tok
    model = save_model("llama3", tmp_path / "hf", vocab_size=len(hf))
    save_tokenizer(tmp_path / "hf", kind="word")  # init_from's tokenizer is the data tokenizer
    rows = [{"conversations": [{"from": "human", "value": "what is two plus two?"},
                               {"from": "gpt", "value": "it is four."}]}]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    from megatrain_ray.orchestration.local import train_local

    cfg = load_train_config(None, [
        f"train.init_from={tmp_path / 'hf'}", f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path / 'runs'}",
        "compute.device=cpu", "precision.compute_dtype=float32", f"data.path={tmp_path / 'sft.jsonl'}",
        "data.num_workers=1", "train.steps=1", "train.seq_len=24", "train.micro_batch_size=2",
        "train.num_micro_batches=1"])
    losses = [row["loss"] for row in train_local(cfg, 0)]

    ids = torch.tensor(_ids(hf, ["<|im_start|>", "user", "what", "is", "two", "plus", "two", "?", "<|im_end|>",
                                 "<|im_start|>", "assistant", "it", "is", "four", ".", "<|im_end|>"]))
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].float()
    positions = torch.arange(10, 15)  # the positions whose next token is a response token
    by_hand = F.cross_entropy(logits[positions], ids[positions + 1]).item()
    np.testing.assert_allclose(losses[0], by_hand, rtol=1e-5)
    everything = F.cross_entropy(logits[:-1], ids[1:]).item()
    assert abs(everything - by_hand) > 1e-2  # counting prompt tokens would have given another loss


def test_malformed_alpaca_row_is_one_sentence(tmp_path, ray_cluster):
    (tmp_path / "bad.jsonl").write_text(json.dumps(QUESTION) + "\n" + json.dumps(
        {"instruction": "hi", "output": None, "input": ""}) + "\n")
    cfg = load_config(None, [f"data.path={tmp_path / 'bad.jsonl'}", f"data.cache_dir={tmp_path / 'cache'}",
                             "data.format=alpaca"])
    with pytest.raises(DataError) as err:
        source_from_config(cfg, log=lambda line: None)
    assert str(err.value) == (f"data.path '{tmp_path / 'bad.jsonl'}' line 2: an alpaca row needs text in instruction "
                              "and output, but its output is null.")
    assert not list((tmp_path / "cache").glob("*/meta.json"))  # nothing half-written is left as a cache


def test_sharegpt_without_assistant_and_unknown_roles_are_rejected():
    with pytest.raises(DataError, match="no gpt/assistant turn"):
        messages_from_row({"conversations": [{"from": "human", "value": "hi"}]}, "sharegpt")
    with pytest.raises(DataError, match="from='robot'"):
        messages_from_row({"conversations": [{"from": "robot", "value": "hi"}]}, "sharegpt")


def test_template_that_is_not_prompt_then_response_is_rejected(tmp_path):
    reverse = "{% for m in messages|reverse %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    save_tokenizer(tmp_path / "tok", kind="word", chat_template=reverse)
    with pytest.raises(DataError, match="chat template does not render"):
        HFTokenizer(str(tmp_path / "tok")).encode_chat(messages_from_row(QUESTION, "alpaca"))
