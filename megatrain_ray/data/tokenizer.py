"""Text to token ids: byte-level or a local Hugging Face tokenizer; documents and chat examples.

Two operations, both pure functions of their input:

- :meth:`encode_document` (pretraining): the document's tokens, with the tokenizer's own special
  tokens (a BOS where its post-processor adds one), then EOS. EOS is what marks document
  boundaries once documents are packed into fixed-length sequences.
- :meth:`encode_chat` (SFT): a conversation rendered with the tokenizer's chat template, and a
  0/1 mask of the tokens that belong to assistant responses: the only tokens whose prediction
  counts in the loss. A response is located as the text that the template adds for an assistant
  message after the prompt rendered with ``add_generation_prompt``; so its end-of-turn marker is
  part of it (the model learns to stop), while the role headers and every user, system and
  template token is not. A token counts if its characters overlap a response.

Tokenizers without a chat template (and byte-level) use :data:`DEFAULT_CHAT_TEMPLATE`.
Conversations come from rows in the alpaca (instruction / input / output) or sharegpt
(conversations: [{from, value}]) layouts via :func:`messages_from_row`.

A model trained on byte-level ids is exported with the byte-level tokenizer written as a Hugging
Face one (:func:`save_byte_tokenizer`), which gives the same ids, so ``transformers`` can encode,
generate and decode with it.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

from ..errors import DataError
from .builtin import BYTE_TOKENIZER_VOCAB, EOS_ID, encode_bytes

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
"""Chat layout for tokenizers that have none: ``<|role|>\\n`` + content (+ EOS for the assistant) + ``\\n``."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
"""Files of a Hugging Face tokenizer: hashed for cache keys, copied along with exported weights."""
BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
"""The exported byte-level tokenizer's chat template: the layout :meth:`ByteTokenizer.encode_chat`
trains on, written for transformers' renderer (which drops a newline that follows a block tag, so
every newline here is inside an expression)."""
BYTE_LEVEL = "bytes"
"""Names the byte-level tokenizer where a tokenizer directory would otherwise go (see :func:`load_tokenizer`)."""
EOS_TOKEN = "<|endoftext|>"
"""The text of the byte-level EOS id in the exported Hugging Face tokenizer."""
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
         "system": "system"}
"""sharegpt ``from`` values and the chat roles they mean."""


def is_tokenizer_dir(path: str | None) -> bool:
    """Whether ``path`` is a directory holding a Hugging Face tokenizer."""
    return bool(path) and os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, n)) for n in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def tokenizer_fingerprint(path: str | None) -> str:
    """A hash of the tokenizer's files (``bytes`` for byte-level), for cache keys."""
    if path is None:
        return "bytes"
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        full = os.path.join(path, name)
        if os.path.isfile(full):
            h.update(name.encode())
            with open(full, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255, EOS is 256 (see :mod:`megatrain_ray.data.loader`)."""

    vocab_size = BYTE_TOKENIZER_VOCAB
    eos_id = EOS_ID
    bos_id = None
    pad_id = EOS_ID

    def encode_document(self, text: str) -> np.ndarray:
        """[n + 1] int32: the bytes, then EOS."""
        return np.append(encode_bytes(text), np.int32(EOS_ID)).astype(np.int32)

    def end_of_turn_ids(self) -> list[int]:
        """The ids that end an assistant turn: EOS (see :meth:`HFTokenizer.end_of_turn_ids`)."""
        return [EOS_ID]

    def encode_chat(self, messages: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
        """DEFAULT_CHAT_TEMPLATE with EOS as the id 256; returns ids [n] int32 and mask [n] uint8."""
        ids, mask = [], []
        for m in messages:
            head = encode_bytes(f"<|{m['role']}|>\n")
            ids.append(head)
            mask.append(np.zeros(len(head), np.uint8))
            body = encode_bytes(m["content"])
            if m["role"] == "assistant":
                body = np.concatenate([body, [EOS_ID], encode_bytes("\n")]).astype(np.int32)
            else:
                body = np.concatenate([body, encode_bytes("\n")]).astype(np.int32)
            ids.append(body)
            mask.append(np.full(len(body), m["role"] == "assistant", np.uint8))
        return np.concatenate(ids).astype(np.int32), np.concatenate(mask)


class HFTokenizer:
    """A Hugging Face tokenizer from a local directory (``tokenizer.json`` etc.; never downloads)."""

    def __init__(self, directory: str):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core per pool actor
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise DataError(f"data.tokenizer {directory!r} needs the transformers package; "
                            "pip install transformers (or use byte-level data without data.tokenizer).") from None

        try:
            self.hf = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except Exception as e:  # transformers raises many types for a broken directory
            raise DataError(f"data.tokenizer {directory!r} is not a loadable Hugging Face tokenizer "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}).") from None
        if not getattr(self.hf, "is_fast", False):
            raise DataError(f"data.tokenizer {directory!r} has no fast tokenizer (tokenizer.json), which "
                            "response masking needs; convert it with transformers and save it again.")
        if self.hf.eos_token_id is None:
            raise DataError(f"data.tokenizer {directory!r} defines no eos_token; set one in tokenizer_config.json.")
        self.eos_id = int(self.hf.eos_token_id)
        self.bos_id = None if self.hf.bos_token_id is None else int(self.hf.bos_token_id)
        self.pad_id = int(self.hf.pad_token_id) if self.hf.pad_token_id is not None else self.eos_id
        self.vocab_size = len(self.hf)
        self.template = self.hf.chat_template or DEFAULT_CHAT_TEMPLATE

    def encode_document(self, text: str) -> np.ndarray:
        ids = self.hf(text, add_special_tokens=True)["input_ids"]
        if not ids or ids[-1] != self.eos_id:
            ids = [*ids, self.eos_id]
        return np.asarray(ids, dtype=np.int32)

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        if not messages and generation_prompt is False:
            return ""
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                           chat_template=self.template)

    def end_of_turn_ids(self) -> list[int]:
        """The special tokens the chat template puts right after an assistant's response (Qwen's
        ``<|im_end|>``, Llama 3's ``<|eot_id|>``), else EOS: where a fine-tuned model's turn ends, so
        ``generate`` must stop there."""
        reply = "megatrain-end-of-turn-probe"
        try:
            text = self._render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": reply}], False)
        except Exception:  # noqa: BLE001 (a template that cannot render this: EOS alone)
            return [self.eos_id]
        after = text[text.rfind(reply) + len(reply):] if reply in text else ""
        special = set(self.hf.all_special_ids) | {i for i, t in self.hf.added_tokens_decoder.items() if t.special}
        ids = [i for i in self.hf(after, add_special_tokens=False)["input_ids"] if i in special][:1]
        return ids or [self.eos_id]

    def encode_chat(self, messages: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
        full = self._render(messages, False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self._render(messages[:i], True) if i else ""
            upto = self._render(messages[:i + 1], False)
            if not (full.startswith(upto) and upto.startswith(prompt)):
                raise DataError("the tokenizer's chat template does not render a conversation as its prompt "
                                "followed by the response, so response tokens cannot be located; set "
                                "data.tokenizer to one whose template does, or remove its chat_template.")
            spans.append((len(prompt), len(upto)))
        enc = self.hf(full, add_special_tokens=False, return_offsets_mapping=True)
        mask = [any(s < b and e > a for a, b in spans) for s, e in enc["offset_mapping"]]
        return np.asarray(enc["input_ids"], dtype=np.int32), np.asarray(mask, dtype=np.uint8)


def as_token_ids(value: Any, where: str) -> np.ndarray:
    """A row's pre-tokenized ids (a list of integers) as [n] int64; anything else (text, floats,
    nested lists) is one DataError naming ``where`` and showing the value."""
    try:
        ids = np.asarray(value) if isinstance(value, (list, tuple, np.ndarray)) else None
    except ValueError:  # ragged nested lists
        ids = None
    if ids is None or ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        shown = repr(value if not isinstance(value, np.ndarray) else value.tolist())
        raise DataError(f"{where} must be a list of integer token ids, got {shown[:60]}"
                        f"{'...' if len(shown) > 60 else ''}.")
    return ids.astype(np.int64)


def load_tokenizer(directory: str | None):
    """A tokenizer for ``directory`` (an HF tokenizer directory), or byte-level for None or BYTE_LEVEL."""
    return ByteTokenizer() if directory in (None, BYTE_LEVEL) else HFTokenizer(directory)


def _byte_chars() -> list[str]:
    """The printable character standing for each byte 0..255 in a byte-level BPE vocabulary (GPT-2's
    table: printable Latin-1 bytes stand for themselves, the others for chr(256 + n) in order)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, extra = [], 0
    for b in range(256):
        chars.append(chr(b) if b in printable else chr(256 + extra))
        extra += b not in printable
    return chars


def save_byte_tokenizer(directory: str) -> list[str]:
    """Write the byte-level tokenizer as a Hugging Face fast tokenizer; returns the files written.

    Ids as :class:`ByteTokenizer`: byte b is id b (a byte-level BPE without merges), EOS_TOKEN is
    EOS_ID, and three reserved special tokens fill the vocabulary up to BYTE_TOKENIZER_VOCAB; no BOS;
    :data:`BYTE_CHAT_TEMPLATE` as the chat template.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(_byte_chars())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = [EOS_TOKEN] + [f"<|reserved_{i}|>" for i in range(BYTE_TOKENIZER_VOCAB - EOS_ID - 1)]
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    assert tok.token_to_id(EOS_TOKEN) == EOS_ID and tok.get_vocab_size() == BYTE_TOKENIZER_VOCAB
    # A causal LM takes no token_type_ids; transformers 4's fast tokenizer returns them unless told, and
    # generate(**tokenizer(prompt)) then refuses them.
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                 model_input_names=["input_ids", "attention_mask"])
    hf.chat_template = BYTE_CHAT_TEMPLATE
    os.makedirs(directory, exist_ok=True)
    hf.save_pretrained(directory)
    return [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(directory, n))]


def messages_from_row(row: dict[str, Any], layout: str) -> list[dict[str, str]]:
    """Chat messages [{role, content}] of one alpaca or sharegpt row; malformed rows are DataErrors."""
    if layout == "alpaca":
        bad = [f"its {k} is {_what(row, k)}" for k in ("instruction", "output") if not isinstance(row.get(k), str)]
        if bad:
            raise DataError(f"an alpaca row needs text in instruction and output, but {' and '.join(bad)}.")
        prompt = row["instruction"]
        if isinstance(row.get("input"), str) and row["input"].strip():
            prompt += "\n\n" + row["input"]
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]
        if isinstance(row.get("system"), str) and row["system"].strip():
            messages.insert(0, {"role": "system", "content": row["system"]})
        return messages
    turns = row.get("conversations")
    if not isinstance(turns, (list, tuple)) or not turns:
        what = "an empty list" if isinstance(turns, (list, tuple)) else _what(row, "conversations")
        raise DataError(f"a sharegpt row needs 'conversations' as a non-empty list of turns, but its conversations "
                        f"is {what}.")
    messages = []
    for turn in turns:
        if isinstance(turn, str):
            turn = json.loads(turn)
        who = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if who not in ROLES or not isinstance(text, str):
            raise DataError(f"a sharegpt turn must have 'from' in {', '.join(ROLES)} and a text 'value', "
                            f"got from={who!r}.")
        messages.append({"role": ROLES[who], "content": text})
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError("a sharegpt conversation has no gpt/assistant turn, so nothing to train on.")
    return messages


def _what(row: dict[str, Any], key: str) -> str:
    """How a row's field reads in a message: missing, null, or its type (``a number``, ``a string``)."""
    if key not in row:
        return "missing"
    value = row[key]
    if value is None:
        return "null"
    kinds = {str: "a string", bool: "true/false", int: "a number", float: "a number", list: "a list",
             tuple: "a list", dict: "an object"}
    return kinds.get(type(value), f"a {type(value).__name__}")
