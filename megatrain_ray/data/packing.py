"""Document boundaries of packed sequences (``data.pack_documents``), as the loaders deliver them.

A packed batch carries, besides ``input_ids`` and ``labels``, ``position_ids`` [.., S] int64: each
input token's position within its document, 0 where a document starts. That is all the model needs
(:func:`megatrain_ray.model.transformer.document_mask` derives the documents from the zeros; RoPE
takes the positions as they are), so the on-disk corpus format is unchanged: the prepared cache
already records where each document starts (``<split>.offsets.npy``), and text read as random
windows marks each document's end with EOS.

Rules, the same for pretraining packs and packed SFT:

- a document cut by the start of a sequence counts from 0 at the sequence's first token;
- the label of a document's last token (which would be the next document's first token) is
  ``IGNORE_INDEX``: nothing is learnt across a boundary, so each document's per-token losses are
  exactly those of the document run alone;
- packed SFT (:func:`pack_rows`): examples are placed whole, in corpus order, into sequences of S
  tokens (one longer than S is cut to S), the rest of a sequence padded with the pad id as one more
  document with no targets.
"""

from __future__ import annotations

import numpy as np

from ..errors import DataError

IGNORE_INDEX = -100
"""model.IGNORE_INDEX, repeated so that loader actors do not import torch (tests check they agree)."""


def document_positions(starts: np.ndarray, begin: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions in the window ``stream[begin : begin + length]`` of a token stream whose documents
    start at the sorted indices ``starts`` [D].

    Returns position_ids [length] int64 (see the module docstring) and ends [length] bool, True
    where the next token of the stream starts a new document.
    """
    starts = np.asarray(starts, dtype=np.int64)
    t = np.arange(begin, begin + length, dtype=np.int64)
    k = np.searchsorted(starts, t, side="right") - 1
    first = np.where(k >= 0, starts[np.maximum(k, 0)], begin)
    pos = t - np.maximum(first, begin)
    j = np.searchsorted(starts, t + 1, side="left")
    ends = (j < len(starts)) & (starts[np.minimum(j, len(starts) - 1)] == t + 1)
    return pos, ends


def eos_starts(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """Document starts of an EOS-separated token stream [T]: 0 and each index after an EOS."""
    return np.concatenate([[0], np.flatnonzero(np.asarray(tokens) == eos_id) + 1]).astype(np.int64)


def pack_rows(lengths: np.ndarray, capacity: int) -> list[np.ndarray]:
    """Examples of ``lengths`` [D] tokens, in order, into sequences of ``capacity`` tokens (next fit:
    a sequence is closed when the next example does not fit; one longer than capacity fills one
    alone, cut) -> the example indices of each sequence."""
    bins, current, used = [], [], 0
    for k, n in enumerate(np.minimum(np.asarray(lengths, dtype=np.int64), capacity)):
        if current and used + n > capacity:
            bins.append(np.asarray(current, dtype=np.int64))
            current, used = [], 0
        current.append(k)
        used += int(n)
    if current:
        bins.append(np.asarray(current, dtype=np.int64))
    return bins


def packed_row(tokens, mask, starts, lengths, examples: np.ndarray, seq_len: int, pad_id: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One packed SFT sequence: input_ids, labels, position_ids, each [seq_len] int64.

    tokens [T], mask [T] uint8 (target tokens; None = all) and starts, lengths [D] describe the
    examples; ``examples`` are the indices of this sequence's (from :func:`pack_rows`).
    """
    ids = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    pos = np.zeros(seq_len, dtype=np.int64)
    at = 0
    for k in examples:
        start, n = int(starts[k]), min(int(lengths[k]), seq_len)
        doc = np.asarray(tokens[start:start + n], dtype=np.int64)
        target = np.ones(n, bool) if mask is None else np.asarray(mask[start:start + n]).astype(bool)
        ids[at:at + n] = doc
        labels[at:at + n - 1] = np.where(target[1:], doc[1:], IGNORE_INDEX)
        pos[at:at + n] = np.arange(n)
        at += n
    pos[at:] = np.arange(seq_len - at)  # the padding: one more document, without targets
    return ids, labels, pos


def no_boundaries(where: str) -> DataError:
    """The error for data.pack_documents on data that records no document boundaries."""
    return DataError(f"data.pack_documents needs document boundaries, but {where} is one 1-D .npy token stream "
                     "without any; use data.format text or tokens with one row per document, or set "
                     "data.pack_documents=false.")
