"""What needs no files: byte-level token ids (UTF-8 bytes, EOS) and the generated built-in corpus:
its short documents, and the long documents (:func:`builtin_long_document`) that fill long sequences.

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


BUILTIN_SEED = 1234
"""Seeds the grammar of the short documents; the long ones are seeded by this plus their number."""
BUILTIN_LONG_DOCUMENTS = 8
"""Training documents of the built-in corpus when its documents are long (data.builtin_document_tokens)."""
BUILTIN_LONG_VAL_DOCUMENTS = 1
"""Held-out long documents (its validation split), generated after the training ones."""


def _paragraph(rng: random.Random) -> str:
    """3 to 8 sentences of the grammar (~250 B)."""
    sentences = []
    for _ in range(rng.randint(3, 8)):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_ENDINGS)}"
        sentences.append(s[0].upper() + s[1:])
    return " ".join(sentences)


def builtin_corpus(num_documents: int = BUILTIN_DOCUMENTS, seed: int = BUILTIN_SEED) -> str:
    """A small, deterministic English-like corpus generated from a fixed grammar (~250 B per document),
    one document per line."""
    rng = random.Random(seed)
    return "\n".join(_paragraph(rng) for _ in range(num_documents))


def builtin_long_document(split: str, index: int, num_bytes: int) -> str:
    """Long document ``index`` of one split (``train``: 0 .. BUILTIN_LONG_DOCUMENTS - 1, ``val``: the
    BUILTIN_LONG_VAL_DOCUMENTS after them): paragraphs of the grammar, one a line, seeded by the
    document's number, until the text holds at least ``num_bytes`` bytes (ASCII). A longer one
    begins with the shorter: the same paragraphs, more of them."""
    number = index + (BUILTIN_LONG_DOCUMENTS if split == "val" else 0)
    rng = random.Random(BUILTIN_SEED + 1 + number)
    paragraphs, size = [], 0
    while size < num_bytes:
        paragraphs.append(_paragraph(rng))
        size += len(paragraphs[-1]) + 1
    return "\n".join(paragraphs)


def builtin_documents(split: str = "train") -> list[str]:
    """The documents of one split of the built-in corpus: ``train`` (the first BUILTIN_DOCUMENTS the
    grammar generates) or ``val`` (the BUILTIN_VAL_DOCUMENTS after them, which training never sees)."""
    docs = builtin_corpus(BUILTIN_DOCUMENTS + BUILTIN_VAL_DOCUMENTS).split("\n")
    return docs[:BUILTIN_DOCUMENTS] if split == "train" else docs[BUILTIN_DOCUMENTS:]
