"""Training tokens: random windows of a token stream, and which data-loader a config gets.

Two kinds of loader, both plain classes made remote at spawn, both with ``batch(step)``:

- :class:`BatchSource` (``data.format: windows``, the default for one ``.txt`` or 1-D ``.npy``
  file and for the built-in corpus when data.val_fraction holds nothing out of them): each
  sequence is a random window of ``seq_len + 1`` tokens of the whole token stream, drawn with
  ``numpy.random.default_rng([seed, step])``.
- :class:`~megatrain_ray.data.corpus.CorpusSource` (text, alpaca, sharegpt, tokens): epochs over a
  corpus tokenized by Ray Data (:mod:`megatrain_ray.data.datasets`).

In both, the batch of step ``t`` depends only on (data, seed, t), never on how many loader actors
there are or which one made it, so a run is reproducible, a loader can be restarted, and a resumed
run continues with exactly the batches it would have seen. Inputs are a sequence's first
``seq_len`` tokens, labels its last ``seq_len`` (next-token prediction).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable

import numpy as np

from ..errors import DataError
from .builtin import EOS_ID, builtin_documents, encode_bytes
from .packing import IGNORE_INDEX, document_positions, eos_starts, no_boundaries
from .tokenizer import as_token_ids

Connect = Callable[[object], None]
"""Joins or starts Ray for a config before Ray Data tokenizes (the orchestration's ``connect_ray``);
without one, Ray Data starts a local Ray of its own when none is running."""


def load_tokens(path: str | None) -> np.ndarray:
    """The token stream [n] int64: the built-in corpus, a .txt file (bytes) or a .npy array."""
    if path is None:
        docs = builtin_documents("train")
    elif path.endswith(".npy"):
        from .datasets import open_npy

        tokens = open_npy(path, f"data.path {path!r}")
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

    ORDER = ("each step's window starts drawn by numpy.random.default_rng([train.seed, step]).integers; "
             "no state carries over from step to step")
    """How the batches are drawn, recorded in each checkpoint's meta.json (rng.data_order)."""

    def __init__(self, path: str | None, seq_len: int, micro_batch_size: int, num_micro_batches: int,
                 seed: int, vocab_size: int, pack_documents: bool = False, pinned: str | None = None):
        """``pinned``: the :attr:`fingerprint` of the tokens the run started with (see :func:`run_data`)."""
        self.tokens = load_tokens(path)
        if pinned is not None and self.fingerprint != pinned:
            raise DataError(f"data.path {path!r} changed since the run started (its tokens differ from those it "
                            "began with), so the run cannot go on with the data it trained on; restore the file, "
                            "or start a new run on the changed data.")
        self.starts = None
        """Document starts when packing (data.pack_documents): after each EOS of the text read."""
        if pack_documents:
            if path is not None and path.endswith(".npy"):
                raise no_boundaries(f"data.path {path!r}")
            self.starts = eos_starts(self.tokens, EOS_ID)
        self.shape = (num_micro_batches, micro_batch_size)
        self.seq_len = seq_len
        self.seed = seed
        where = f"data.path {path!r}" if path else "the built-in corpus"
        if self.tokens.size < seq_len + 2:
            raise DataError(f"{where} has {self.tokens.size} tokens, fewer than train.seq_len + 2 "
                            f"({seq_len + 2}); use more data or a shorter train.seq_len.")
        low, top = int(self.tokens.min()), int(self.tokens.max())
        if low < 0 or top >= vocab_size:
            bad = low if low < 0 else top
            raise DataError(f"{where} holds token id {bad} (at index {int(np.argmax(self.tokens == bad))}), outside "
                            f"[0, model.vocab_size ({vocab_size})); the data and the model's vocabulary do not match.")

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """input_ids, labels (and position_ids when packing): [M, B, S] int64 for optimizer step ``step``."""
        rng = np.random.default_rng([self.seed, step])
        count = self.shape[0] * self.shape[1]
        starts = rng.integers(0, self.tokens.size - self.seq_len - 1, size=count)
        windows = np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts])
        windows = windows.reshape(*self.shape, self.seq_len + 1)
        out = {"input_ids": windows[..., :-1].copy(), "labels": windows[..., 1:].copy()}
        if self.starts is not None:
            pos, ends = zip(*(document_positions(self.starts, int(s), self.seq_len) for s in starts))
            out["position_ids"] = np.stack(pos).reshape(*self.shape, self.seq_len)
            out["labels"][np.stack(ends).reshape(*self.shape, self.seq_len)] = IGNORE_INDEX
        return out

    def state(self, next_step: int) -> dict:
        """The read position before step ``next_step``, for a checkpoint (JSON-serialisable)."""
        return {"fingerprint": self.fingerprint, "seed": self.seed, "seq_len": self.seq_len,
                "batch_shape": list(self.shape), "next_step": next_step,
                **({"pack_documents": True} if self.starts is not None else {})}

    def resume_step(self, state: dict) -> int:
        """The step to continue from, after checking that ``state`` came from this same data and order."""
        changed = [k for k, v in self.state(0).items() if k != "next_step" and state.get(k) != v]
        if state.get("pack_documents", False) != (self.starts is not None) and "pack_documents" not in changed:
            changed.append("pack_documents")
        if changed == ["fingerprint"]:
            raise DataError("cannot resume: the checkpoint was trained on other tokens (the text of data.path "
                            "changed since, or another file is named); restore the data it was trained on, or "
                            "start afresh from its weights with train.init_from set to the checkpoint (no "
                            "--resume).")
        if changed:
            raise DataError(f"cannot resume: the checkpoint's data position was taken with a different "
                            f"{', '.join(changed)}; resume with the data and train settings it was saved with.")
        return int(state["next_step"])

    @property
    def fingerprint(self) -> str:
        """A hash of the token stream (the windows are drawn from it)."""
        return hashlib.sha256(np.ascontiguousarray(self.tokens).view(np.uint8)).hexdigest()[:20]


def uses_windows(cfg) -> bool:
    """Whether the config's training data is read by :class:`BatchSource` (random windows)."""
    from .datasets import dataset_spec

    return dataset_spec(cfg.data, cfg.train.init_from, cfg.data.path).format == "windows"


def corpus_ref(cfg, split: str = "train", log=print, connect: Connect | None = None):
    """The prepared corpus (a CorpusRef) of one split, tokenizing into the cache first if needed.

    ``val`` is data.val_path when set, else the held-out data.val_fraction of data.path, else, for
    the built-in corpus, its own held-out documents (:func:`~megatrain_ray.data.builtin.builtin_documents`). Data that trains as
    random windows is evaluated as a packed corpus of the same tokens.
    """
    from .prepare import prepare

    p, cache = _corpus_spec(cfg, split)
    check_vocab(p, cfg.model.vocab_size)

    def join() -> None:
        connect(cfg)

    return prepare(p, cache, cfg.data.num_workers, join if connect is not None else None, log,
                   stall_s=cfg.cluster.actor_timeout_s)


def corpus_fingerprint(cfg) -> str | None:
    """The fingerprint the training corpus of ``cfg`` has now (its files as they are), without
    tokenizing; None for random windows (whose fingerprint hashes the tokens: :class:`BatchSource`)."""
    from .datasets import fingerprint

    return None if uses_windows(cfg) else fingerprint(_corpus_spec(cfg, "train")[0])


def check_resume_data(state: dict, saved_data: dict, cfg, checkpoint: str) -> None:
    """Refuse, before anything is tokenized, a resume whose training corpus is not the one the
    checkpoint was trained on (``state``: its meta.json ``data``; ``saved_data``: its run's data
    section); random windows are checked by :meth:`BatchSource.resume_step` once read."""
    now = corpus_fingerprint(cfg) if "fingerprint" in state else None
    if now is None or now == state["fingerprint"]:
        return
    changed = [f"data.{k}" for k, v in dataclasses.asdict(cfg.data).items()
               if k in saved_data and saved_data[k] != v and k not in ("num_workers", "cache_dir")]
    files = f"data.path {cfg.data.path!r}" + (f" or of data.tokenizer {cfg.data.tokenizer!r}" if cfg.data.tokenizer
                                              else "")
    what = (f"{', '.join(changed)} differ{'s' if len(changed) == 1 else ''} from the run's" if changed else
            f"the files of {files} changed since ({'a size, a modification time or a tokenizer file' if cfg.data.tokenizer else 'a size or a modification time'} is not what it was)")
    raise DataError(f"cannot resume from {checkpoint}: it was trained on other data ({what}); restore the data it "
                    f"was trained on, or start afresh from its weights with `megatrain-ray train --set "
                    f"train.init_from={checkpoint}` (no --resume).")


def _corpus_spec(cfg, split: str):
    """(DatasetSpec of the corpus of one split, cache root): see :func:`corpus_ref`."""
    from .datasets import dataset_spec

    d = cfg.data
    separate = split == "val" and bool(d.val_path)
    p = dataset_spec(d, cfg.train.init_from, d.val_path if separate else d.path, "data.val_path" if separate else "data.path")
    check_first_row(p)
    builtin_val = split == "val" and not separate and not d.val_fraction and p.kind == "builtin"
    if split == "val" and not separate and not d.val_fraction and not builtin_val:
        raise DataError(f"{p.where} has no validation split; set data.val_fraction or data.val_path.")
    if p.format == "windows":  # the same tokens, as a corpus that can be split and read in order
        p = dataclasses.replace(p, format="tokens" if p.kind == "npy" else "text")
    if builtin_val:
        p = dataclasses.replace(p, kind="builtin-val", where="the built-in corpus's validation documents")
    p = dataclasses.replace(p, val_fraction=1.0 if separate or builtin_val else d.val_fraction)
    return p, d.cache_dir or os.path.join(cfg.train.run_dir, "data-cache")


def check_vocab(p, vocab_size: int) -> None:
    """A tokenizer with more tokens than model.vocab_size is refused before anything is tokenized
    (its ids past the vocabulary would index no embedding row)."""
    if p.format == "tokens":
        return
    from .tokenizer import load_tokenizer

    n = load_tokenizer(p.tokenizer).vocab_size
    if n > vocab_size:
        name = f"data.tokenizer {p.tokenizer!r}" if p.tokenizer else "the byte-level tokenizer"
        raise DataError(f"{name} has {n} tokens, more than model.vocab_size ({vocab_size}); use the model's own "
                        f"tokenizer, or a model whose vocabulary holds at least {n} tokens.")


def check_first_row(p) -> None:
    """Pre-tokenized rows (format tokens, in .jsonl/.json/.parquet/.arrow): the first row's (or the
    schema's) input_ids must be a list of integers, checked here before Ray starts; the tokenizer
    pool checks every row as it reads it (:func:`~megatrain_ray.data.tokenizer.as_token_ids`). A ``.txt``
    file's first 64 KiB must be UTF-8 (a binary file named .txt is refused here, not in the pool)."""
    if p.kind == "txt":
        import codecs

        empty = []
        for path in p.files:
            with open(path, "rb") as f:
                head = f.read(1 << 16)
            if not head.strip() and os.path.getsize(path) <= len(head):
                empty.append(path)
            try:
                codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a character cut at the end is fine
            except UnicodeDecodeError as e:
                which = p.where if len(p.files) == 1 else f"{p.where}: {os.path.basename(path)!r}"
                raise DataError(f"{which} is not UTF-8 text ({e.reason} at byte {e.start}); give a text file, or "
                                "token ids as .npy.") from None
        if len(empty) == len(p.files):
            what = "is empty" if len(p.files) == 1 else f"holds only empty .txt files ({len(empty)})"
            raise DataError(f"{p.where} {what}: there is no text to train on; point data.path at the text meant.")
        return
    if p.format != "tokens" or p.kind not in ("jsonl", "json", "parquet", "arrow"):
        return
    where = f"{p.where}: the first row{'' if len(p.files) == 1 else ' of ' + os.path.basename(p.files[0])}'s input_ids"
    if p.kind in ("parquet", "arrow"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        from .datasets import arrow_reader

        schema = pq.read_schema(p.files[0]) if p.kind == "parquet" else arrow_reader(p.files[0]).schema
        kind = schema.field("input_ids").type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(kind.value_type):
            raise DataError(f"{where} must be a list of integer token ids, but the column is {kind}.")
        return
    import json

    with open(p.files[0], encoding="utf-8") as f:
        if p.kind == "jsonl":
            first = json.loads(next((ln for ln in f if ln.strip()), "{}"))
        else:
            data = json.load(f)
            first = data[0] if isinstance(data, list) and data else data
    as_token_ids(first.get("input_ids"), where)


def loader_spec(cfg, split: str = "train", log=print, connect: Connect | None = None) -> tuple[type, tuple]:
    """(class, constructor arguments) of the data-loader actors of a config."""
    t = cfg.train
    shape = (t.seq_len, t.micro_batch_size, t.num_micro_batches, t.seed, cfg.model.vocab_size,
             cfg.data.pack_documents)
    if split == "train" and uses_windows(cfg):
        return BatchSource, (cfg.data.path and os.path.abspath(cfg.data.path), *shape)
    from .corpus import CorpusSource

    return CorpusSource, (corpus_ref(cfg, split, log, connect), split, *shape)


def run_data(cfg, log=print, connect: Connect | None = None) -> tuple[tuple[type, tuple], object]:
    """(loader spec, source) of a run's training data, read once at the run's start.

    Every attempt's loader actors are built from this one spec, so a restart reads exactly the data
    the run began with: the corpus cache it was tokenized into (data.path is never tokenized again
    while the run lives), or for random windows the file checked against the hash of the tokens
    read now (a file changed since is refused in one sentence)."""
    cls, args = loader_spec(cfg, "train", log, connect)
    source = cls(*args)
    if cls is BatchSource:
        args = (*args, source.fingerprint)
    return (cls, args), source


def source_from_config(cfg, split: str = "train", log=print, connect: Connect | None = None):
    """The batch source of a config's training (or ``val``) data, preparing the data if needed."""
    cls, args = loader_spec(cfg, split, log, connect)
    return cls(*args)
