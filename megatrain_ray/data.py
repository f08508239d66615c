"""Training tokens: a byte-level tokenizer, the built-in corpus, and the data-loader actor logic.

The batch of step ``t`` depends only on (seed, t) and the token stream, never on how many loader
actors there are or which one made it, so a run is reproducible and a loader can be restarted.
Each sequence is a random window of ``seq_len + 1`` tokens: inputs are its first ``seq_len``,
labels its last ``seq_len`` (next-token prediction).
"""

from __future__ import annotations

import os
import random

import numpy as np

from .errors import DataError

BYTE_VOCAB = 256
EOS_ID = 256
"""Separates documents in the byte-level stream (ids 0..255 are bytes)."""
BYTE_TOKENIZER_VOCAB = 260
"""Smallest vocab_size for byte-level data (256 bytes + EOS + 3 reserved ids)."""


def encode_bytes(text: str) -> np.ndarray:
    """UTF-8 bytes as token ids [n] int32."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def decode_bytes(ids) -> str:
    return bytes(int(i) for i in ids if int(i) < BYTE_VOCAB).decode("utf-8", errors="replace")


_SUBJECTS = ["the engineer", "a small model", "the optimizer", "our pipeline", "the host store",
             "every layer", "the scheduler", "a patient reader", "the gradient", "the data loader"]
_VERBS = ["streams", "updates", "checks", "measures", "loads", "writes", "trains", "compares", "moves"]
_OBJECTS = ["the weights", "one layer at a time", "a long sequence", "the loss", "its moments",
            "the next batch", "shared memory", "the checkpoint", "a thousand tokens", "the result"]
_ENDINGS = [".", " again.", " carefully.", " before the next step.", " on the CPU.", " in order."]


def builtin_corpus(num_documents: int = 400, seed: int = 1234) -> str:
    """A small, deterministic English-like corpus generated from a fixed grammar (~100 KB)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(num_documents):
        sentences = []
        for _ in range(rng.randint(3, 8)):
            s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_ENDINGS)}"
            sentences.append(s[0].upper() + s[1:])
        docs.append(" ".join(sentences))
    return "\n".join(docs)


def load_tokens(path: str | None) -> np.ndarray:
    """The token stream [n] int64: the built-in corpus, a .txt file (bytes) or a .npy array."""
    if path is None:
        docs = builtin_corpus().split("\n")
    elif path.endswith(".npy"):
        try:
            tokens = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(f"data.path {path!r} is not a readable .npy array ({e}).") from None
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise DataError(f"data.path {path!r} must hold a 1-D integer array of token ids, "
                            f"got {tokens.ndim}-D {tokens.dtype}.")
        return tokens.astype(np.int64)
    else:
        try:
            with open(path, encoding="utf-8") as f:
                docs = f.read().split("\n\n")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"data.path {path!r} is not a readable UTF-8 text file ({e}).") from None
    pieces = []
    for doc in docs:
        if doc.strip():
            pieces += [encode_bytes(doc), np.array([EOS_ID], dtype=np.int32)]
    if not pieces:
        raise DataError(f"data.path {path!r} holds no text.")
    return np.concatenate(pieces).astype(np.int64)


class BatchSource:
    """Deterministic batches from a token stream (plain class; the data-loader actor's logic)."""

    def __init__(self, path: str | None, seq_len: int, micro_batch_size: int, num_micro_batches: int,
                 seed: int, vocab_size: int):
        self.tokens = load_tokens(path)
        self.shape = (num_micro_batches, micro_batch_size)
        self.seq_len = seq_len
        self.seed = seed
        where = f"data.path {path!r}" if path else "the built-in corpus"
        if self.tokens.size < seq_len + 2:
            raise DataError(f"{where} has {self.tokens.size} tokens, fewer than train.seq_len + 2 "
                            f"({seq_len + 2}); use more data or a shorter train.seq_len.")
        top = int(self.tokens.max())
        if top >= vocab_size or int(self.tokens.min()) < 0:
            raise DataError(f"{where} holds token id {top}, outside model.vocab_size ({vocab_size}); "
                            "the data and the model's vocabulary do not match.")

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """input_ids, labels: [M, B, S] int64 for optimizer step ``step``."""
        rng = np.random.default_rng([self.seed, step])
        count = self.shape[0] * self.shape[1]
        starts = rng.integers(0, self.tokens.size - self.seq_len - 1, size=count)
        windows = np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts])
        windows = windows.reshape(*self.shape, self.seq_len + 1)
        return {"input_ids": windows[..., :-1].copy(), "labels": windows[..., 1:].copy()}


def source_from_config(cfg) -> BatchSource:
    """The BatchSource of a TrainConfig."""
    return BatchSource(cfg.data.path and os.path.abspath(cfg.data.path), cfg.train.seq_len,
                       cfg.train.micro_batch_size, cfg.train.num_micro_batches, cfg.train.seed,
                       cfg.model.vocab_size)
