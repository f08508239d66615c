"""What needs no files: byte-level token ids (UTF-8 bytes, EOS) and the generated built-in corpus.

The byte-level tokenizer (:class:`~megatrain_ray.data.tokenizer.ByteTokenizer`), the windows loader
(:mod:`megatrain_ray.data.loader`) and Ray Data preparation (:mod:`megatrain_ray.data.datasets`)
all build on these; this module imports nothing of the package.
"""

from __future__ import annotations

import random

import numpy as np

BYTE_VOCAB = 256
EOS_ID = 256
"""Separates documents in the byte-level stream (ids 0..255 are bytes)."""
BYTE_TOKENIZER_VOCAB = 260
"""Smallest vocab_size for byte-level data (256 bytes + EOS + 3 reserved ids)."""


def encode_bytes(text: str) -> np.ndarray:
    """UTF-8 bytes as token ids [n] int32."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


_SUBJECTS = ["the engineer", "a small model", "the optimizer", "our pipeline", "the host store",
             "every layer", "the scheduler", "a patient reader", "the gradient", "the data loader"]
_VERBS = ["streams", "updates", "checks", "measures", "loads", "writes", "trains", "compares", "moves"]
_OBJECTS = ["the weights", "one layer at a time", "a long sequence", "the loss", "its moments",
            "the next batch", "shared memory", "the checkpoint", "a thousand tokens", "the result"]
_ENDINGS = [".", " again.", " carefully.", " before the next step.", " on the CPU.", " in order."]


BUILTIN_DOCUMENTS = 400
"""Training documents of the built-in corpus."""
BUILTIN_VAL_DOCUMENTS = 40
"""Held-out documents of the built-in corpus (its validation split), generated after the training ones."""


def builtin_corpus(num_documents: int = BUILTIN_DOCUMENTS, seed: int = 1234) -> str:
    """A small, deterministic English-like corpus generated from a fixed grammar (~250 B per document),
    one document per line."""
    rng = random.Random(seed)
    docs = []
    for _ in range(num_documents):
        sentences = []
        for _ in range(rng.randint(3, 8)):
            s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_ENDINGS)}"
            sentences.append(s[0].upper() + s[1:])
        docs.append(" ".join(sentences))
    return "\n".join(docs)


def builtin_documents(split: str = "train") -> list[str]:
    """The documents of one split of the built-in corpus: ``train`` (the first BUILTIN_DOCUMENTS the
    grammar generates) or ``val`` (the BUILTIN_VAL_DOCUMENTS after them, which training never sees)."""
    docs = builtin_corpus(BUILTIN_DOCUMENTS + BUILTIN_VAL_DOCUMENTS).split("\n")
    return docs[:BUILTIN_DOCUMENTS] if split == "train" else docs[BUILTIN_DOCUMENTS:]
