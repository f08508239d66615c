"""Batches from a prepared corpus: the data-loader actors' logic for tokenized data.

A :class:`CorpusSource` memory-maps one split (train or val) of a corpus
(:class:`~megatrain_ray.data.datasets.CorpusRef`) and serves batches. Its unit of data is a *sample*:

- layout ``packed``: sample k is the window ``tokens[k*S : k*S + S + 1]`` of the concatenated,
  EOS-separated documents (S = train.seq_len), so consecutive samples tile the stream with no
  token lost or repeated; sequences cross document boundaries, which EOS marks (attention is
  causal over the whole sequence, as in GPT-style pretraining).
- layout ``rows``: sample k is example k, truncated to S + 1 tokens and padded with the pad id;
  only tokens whose mask is set (responses, for SFT) are targets. Its batches carry transformers'
  ``attention_mask`` (False on the padding), which a mixture of experts' load-balancing loss reads.

The order is epoch by epoch, each epoch a permutation of all samples seeded by (train.seed,
epoch). Sample g of the run (g = step * M * B + position in the batch) is sample
``perm(epoch = g // n)[g % n]``, so the batch of a step is a pure function of (corpus, seed, step):
any loader actor makes the same batch, and a resumed run asks for the step it stopped at and gets
exactly the batch it would have had (:meth:`CorpusSource.state` / :meth:`CorpusSource.resume_step`).

Inputs are a sample's first S tokens, labels its last S (next-token prediction), with
``IGNORE_INDEX`` where the predicted token is not a target or is padding.

With ``data.pack_documents`` (:mod:`megatrain_ray.data.packing`) batches also carry
``position_ids``: a packed sample keeps its window and gains its documents' positions (no label
across a boundary); for rows, sample k is instead the k-th *pack* of whole examples, in corpus order.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict

import numpy as np

from ..errors import DataError
from .datasets import CorpusRef, is_val, open_npy
from .packing import document_positions, no_boundaries, pack_rows, packed_row

IGNORE_INDEX = -100
"""model.IGNORE_INDEX, repeated so that loader actors do not import torch (tests check they agree)."""


def open_split(ref: CorpusRef, split: str) -> dict:
    """One split, memory-mapped: tokens [T] int; for rows, starts and lengths [D] of the examples;
    mask [T] uint8 of target tokens (or None: all are); max_id, the largest token id."""
    if ref.path.endswith(".npy"):
        return _npy_split(ref, split)
    try:
        with open(os.path.join(ref.path, "meta.json")) as f:
            info = json.load(f)["splits"][split]
    except FileNotFoundError:
        raise DataError(f"the token cache {ref.path} of {ref.where} is gone (removed while the run used it); "
                        "train again, which tokenizes the data anew.") from None
    if info["documents"] == 0:
        what = ("data.val_fraction held out no document; raise it or set data.val_path" if split == "val"
                else "it holds no training document (is data.val_fraction too high?)" if ref.val_fraction
                else "it holds no document with text")
        raise DataError(f"{ref.where} has no {split} data: {what}.")
    offsets = np.load(os.path.join(ref.path, f"{split}.offsets.npy"))
    mask_path = os.path.join(ref.path, f"{split}.mask.bin")
    return {"tokens": np.memmap(os.path.join(ref.path, f"{split}.tokens.bin"), np.int32, "r"),
            "starts": offsets[:-1], "lengths": np.diff(offsets), "max_id": info["max_id"],
            "mask": np.memmap(mask_path, np.uint8, "r") if os.path.isfile(mask_path) else None}


def _npy_split(ref: CorpusRef, split: str) -> dict:
    arr = open_npy(ref.path, ref.where)
    if arr.ndim not in (1, 2):
        raise DataError(f"{ref.where} must hold a 1-D stream or a 2-D array of rows of token ids, got a "
                        f"{arr.ndim}-D array of shape {arr.shape}.")
    if arr.ndim == 1:  # one stream: the tail val_fraction is held out
        cut = int(round(arr.size * (1.0 - ref.val_fraction)))
        tokens = arr[:cut] if split == "train" else arr[cut:]
        rows, width = None, None
    else:  # one example per row, held out by a hash of the row index
        rows = np.flatnonzero(is_val(np.arange(arr.shape[0]), ref.val_fraction) == (split == "val"))
        tokens, width = arr.reshape(-1), arr.shape[1]
    if tokens.size == 0 or (rows is not None and rows.size == 0):
        raise DataError(f"{ref.where} has no {split} data; adjust data.val_fraction.")
    if not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"{ref.where} must hold integer token ids, got {arr.dtype}.")
    if int(arr.min()) < 0:
        flat = arr.reshape(-1)
        at = int(np.argmax(flat < 0))
        raise DataError(f"{ref.where} holds the negative token id {int(flat[at])} (at flat index {at}); token ids "
                        "must be non-negative.")
    return {"tokens": tokens, "starts": None if rows is None else rows * width,
            "lengths": None if rows is None else np.full(rows.size, width), "mask": None,
            "max_id": int(tokens.max())}


class CorpusSource:
    """Deterministic batches of one split of a corpus (plain class; made a loader actor at spawn)."""

    ORDER = ("epoch e is numpy.random.default_rng([train.seed, e, 0x5EED]).permutation of the samples; sample g "
             "of the run (g = step * M * B + position) is perm(g // samples)[g % samples]; no state carries over")
    """How the batches are drawn, recorded in each checkpoint's meta.json (rng.data_order)."""

    def __init__(self, ref: CorpusRef, split: str, seq_len: int, micro_batch_size: int, num_micro_batches: int,
                 seed: int, vocab_size: int, pack_documents: bool = False):
        self.ref, self.split = ref, split
        self.pack = pack_documents
        self.seq_len, self.seed = seq_len, seed
        self.shape = (num_micro_batches, micro_batch_size)
        data = open_split(ref, split)
        self.tokens, self.starts, self.lengths, self.mask = data["tokens"], data["starts"], data["lengths"], data["mask"]
        if ref.layout == "packed":
            self.num_samples = (len(self.tokens) - 1) // seq_len
            if self.num_samples < 1:
                raise DataError(f"{ref.where} has {len(self.tokens)} {split} tokens, fewer than train.seq_len + 1 "
                                f"({seq_len + 1}); use more data or a shorter train.seq_len.")
            if self.pack and self.starts is None:
                raise no_boundaries(ref.where)
        else:
            self.packs = pack_rows(self.lengths, seq_len) if self.pack else None
            self.num_samples = len(self.packs) if self.pack else len(self.starts)
        top = data["max_id"]
        if top >= vocab_size:
            raise DataError(f"{ref.where} holds token id {top}, outside model.vocab_size ({vocab_size}); the "
                            "tokenizer and the model's vocabulary do not match.")
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    # -- order -----------------------------------------------------------------------------

    def _perm(self, epoch: int) -> np.ndarray:
        """The seeded permutation of the samples for one epoch (the last two are kept)."""
        if epoch not in self._perms:
            self._perms[epoch] = np.random.default_rng([self.seed, epoch, 0x5EED]).permutation(self.num_samples)
            while len(self._perms) > 2:
                self._perms.popitem(last=False)
        return self._perms[epoch]

    def sample_ids(self, step: int) -> np.ndarray:
        """[M * B] indices of the samples of optimizer step ``step``."""
        count = self.shape[0] * self.shape[1]
        g = np.arange(step * count, (step + 1) * count, dtype=np.int64)
        epoch, pos = np.divmod(g, self.num_samples)
        out = np.empty(count, dtype=np.int64)
        for e in np.unique(epoch):
            chosen = epoch == e
            out[chosen] = self._perm(int(e))[pos[chosen]]
        return out

    # -- batches ---------------------------------------------------------------------------

    def samples(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """input_ids, labels: [len(ids), S] int64 of the given samples; for rows, also
        attention_mask [len(ids), S] bool, transformers' mask of the padding (False where a row is
        padded), which only the load-balancing loss of a mixture of experts reads."""
        s = self.seq_len
        if self.ref.layout == "packed":
            windows = np.stack([np.asarray(self.tokens[k * s:k * s + s + 1]) for k in ids]).astype(np.int64)
            out = {"input_ids": windows[:, :-1].copy(), "labels": windows[:, 1:].copy()}
            if self.pack:
                pos, ends = zip(*(document_positions(self.starts, int(k) * s, s) for k in ids))
                out["position_ids"] = np.stack(pos)
                out["labels"][np.stack(ends)] = IGNORE_INDEX
            return out
        if self.pack:
            rows = [packed_row(self.tokens, self.mask, self.starts, self.lengths, self.packs[k], s, self.ref.pad_id)
                    for k in ids]
            out = {name: np.stack(col) for name, col in zip(("input_ids", "labels", "position_ids"), zip(*rows))}
            used = [min(s, int(np.minimum(self.lengths[self.packs[k]], s).sum())) for k in ids]
            out["attention_mask"] = np.arange(s)[None, :] < np.asarray(used)[:, None]
            return out
        seqs = np.full((len(ids), s + 1), self.ref.pad_id, dtype=np.int64)
        target = np.zeros((len(ids), s + 1), dtype=bool)
        used = np.zeros(len(ids), dtype=np.int64)
        for r, k in enumerate(ids):
            start, n = int(self.starts[k]), min(int(self.lengths[k]), s + 1)
            seqs[r, :n] = self.tokens[start:start + n]
            target[r, :n] = True if self.mask is None else self.mask[start:start + n].astype(bool)
            used[r] = n
        labels = np.where(target[:, 1:], seqs[:, 1:], IGNORE_INDEX)
        return {"input_ids": seqs[:, :-1].copy(), "labels": labels,
                "attention_mask": np.arange(s)[None, :] < used[:, None]}

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """input_ids, labels (and position_ids when packing, attention_mask for rows): [M, B, S] for
        optimizer step ``step``."""
        out = self.samples(self.sample_ids(step))
        return {k: v.reshape(*self.shape, self.seq_len) for k, v in out.items()}

    def eval_batches(self, batch_size: int):
        """Every sample once, in corpus order, as batches of input_ids, labels: [b <= batch_size, S]."""
        for start in range(0, self.num_samples, batch_size):
            yield self.samples(np.arange(start, min(start + batch_size, self.num_samples)))

    # -- resume ----------------------------------------------------------------------------

    def state(self, next_step: int) -> dict:
        """The read position before step ``next_step``, for a checkpoint (JSON-serialisable)."""
        g = next_step * self.shape[0] * self.shape[1]
        return {"fingerprint": self.ref.fingerprint, "split": self.split, "seed": self.seed,
                "seq_len": self.seq_len, "batch_shape": list(self.shape), "next_step": next_step,
                "pack_documents": self.pack,
                "epoch": g // self.num_samples, "sample_in_epoch": g % self.num_samples}

    def resume_step(self, state: dict) -> int:
        """The step to continue from, after checking that ``state`` came from this same data and order."""
        mine = self.state(int(state["next_step"]))
        changed = [k for k in ("fingerprint", "split", "seed", "seq_len", "batch_shape") if state.get(k) != mine[k]]
        if state.get("pack_documents", False) != self.pack:  # absent from checkpoints before packing
            changed.append("data.pack_documents")
        if changed:
            raise DataError(f"cannot resume: the checkpoint's data position was taken with a different "
                            f"{', '.join(changed)}; resume with the data and train settings it was saved with.")
        return int(state["next_step"])
