"""Which training data a config names: files, format, tokenizer, cache key and validation split.

A dataset is resolved from the ``data`` config section (:func:`dataset_spec`): its files (one file, or a
directory of files of one kind: ``.txt``, ``.jsonl``/``.json``, ``.parquet``, ``.arrow``, ``.npy``),
its format and its tokenizer. :func:`megatrain_ray.data.prepare.prepare` then turns it into a
*corpus* (a :class:`CorpusRef`): token ids in document order on disk, memory-mapped by every
data-loader actor.

The built-in corpus (no files) is text: its short documents, or its long ones generated to a
length in tokens (``data.builtin_document_tokens``: :func:`megatrain_ray.data.prepare.long_documents`).

- ``text``: each document (a row's ``data.text_key`` field, or a blank-line-separated paragraph
  of a ``.txt`` file) is tokenized and ends with EOS; documents are concatenated (layout
  ``packed``: fixed-length sequences are later cut from the stream).
- ``alpaca`` / ``sharegpt``: each row is one conversation, rendered with the chat template, with a
  mask of its response tokens (layout ``rows``: one example per sequence).
- ``tokens``: pre-tokenized ``input_ids`` (optionally ``labels`` with -100 or a 0/1 ``loss_mask``);
  a 1-D ``.npy`` stream or a 2-D ``.npy`` array of rows is memory-mapped in place, not copied.

Tokenizing and caching a dataset's corpus is :mod:`megatrain_ray.data.prepare`'s work.

Validation split: a document goes to ``val`` when a fixed hash of its index falls below
``data.val_fraction`` (independent of the training seed), else to ``train``; or all of
``data.val_path`` is ``val``; without either, the built-in corpus's ``val`` is its own held-out
documents (:func:`megatrain_ray.data.builtin.builtin_documents`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np

from ..errors import DataError
from .tokenizer import BYTE_LEVEL, is_tokenizer_dir, tokenizer_fingerprint

CACHE_VERSION = 1
EXTENSIONS = {".txt": "txt", ".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow",
              ".npy": "npy"}
LABEL_COLUMNS = ("labels", "loss_mask")
SPLIT_SALT = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset as resolved from the config: files, format, tokenizer (small and picklable)."""

    files: tuple[str, ...]
    """Absolute paths in sorted order; empty for the built-in corpus."""
    kind: str
    """File kind: txt, jsonl, json, parquet, arrow, npy, builtin (the built-in corpus's training
    documents) or builtin-val (its held-out ones)."""
    format: str
    """text, alpaca, sharegpt, tokens or windows (the original random windows; not prepared)."""
    tokenizer: str | None
    """HF tokenizer directory, or None for byte-level."""
    text_key: str
    has_labels: bool
    """Whether each example carries its own loss mask (chat formats, tokens with labels)."""
    val_fraction: float
    where: str
    """How error messages name the data (``data.path '...'``)."""
    document_tokens: int = 0
    """The built-in corpus: 0 for its short documents, else the least length of its long ones
    (data.builtin_document_tokens)."""

    @property
    def layout(self) -> str:
        """packed (documents concatenated, sequences cut from the stream) or rows (one example each)."""
        return "rows" if self.has_labels else "packed"


@dataclass(frozen=True)
class CorpusRef:
    """Where a prepared corpus is and how to read it (what the loader actors receive)."""

    path: str
    """The cache directory, or the .npy file itself for a memory-mapped token array."""
    layout: str
    """packed or rows."""
    fingerprint: str
    pad_id: int
    val_fraction: float
    """For a .npy array: held-out share (its tail when packed, hashed rows otherwise)."""
    where: str


# ---------------------------------------------------------------------------------------------
# Planning: files, format, tokenizer.

def list_files(path: str | None, key: str) -> tuple[tuple[str, ...], str]:
    """(sorted absolute files, kind) of a data path: one file, or a directory of one kind of file."""
    if path is None:
        return (), "builtin"
    path = os.path.abspath(path)
    if os.path.isdir(path):
        files = sorted(os.path.join(path, n) for n in os.listdir(path)
                       if os.path.splitext(n)[1] in EXTENSIONS and os.path.isfile(os.path.join(path, n)))
        kinds = sorted({EXTENSIONS[os.path.splitext(f)[1]] for f in files})
        if not files:
            raise DataError(f"{key} {path!r} holds no .txt, .jsonl, .json, .parquet, .arrow or .npy file.")
        if len(kinds) > 1:
            raise DataError(f"{key} {path!r} mixes file kinds ({', '.join(kinds)}); keep one kind per directory.")
        return tuple(files), kinds[0]
    if not os.path.exists(path):
        raise DataError(f"{key} {path!r} does not exist.")
    ext = os.path.splitext(path)[1]
    if ext not in EXTENSIONS or not os.path.isfile(path):
        raise DataError(f"{key} {path!r} must be a .txt, .jsonl, .json, .parquet, .arrow or .npy file, or a "
                        "directory of them.")
    return (path,), EXTENSIONS[ext]


def open_npy(path: str, where: str) -> np.ndarray:
    """A .npy file memory-mapped, or one DataError naming ``where`` if it is not a .npy array."""
    try:
        with open(path, "rb") as f:
            if f.read(6) != b"\x93NUMPY":
                raise ValueError("it does not start with the .npy header; write token ids with numpy.save")
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DataError(f"{where} is not a readable .npy array ({e}).") from None


def columns(path: str, kind: str) -> list[str]:
    """Column (field) names of a table-like data file, from its schema or first record."""
    import pyarrow.parquet as pq

    try:
        if kind == "parquet":
            return list(pq.read_schema(path).names)
        if kind == "arrow":
            return list(arrow_reader(path).schema.names)
        with open(path, encoding="utf-8") as f:
            if path.endswith(".jsonl"):
                line = next((ln for ln in f if ln.strip()), "{}")
                first = json.loads(line)
            else:
                data = json.load(f)
                first = data[0] if isinstance(data, list) and data else data
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise DataError(f"data file {path!r} cannot be read as {kind} ({e}).") from None
    if not isinstance(first, dict):
        raise DataError(f"data file {path!r} must hold JSON objects (one per line for .jsonl).")
    return list(first)


def arrow_reader(path: str):
    """A reader of an Arrow IPC file, in the file format or the stream format."""
    import pyarrow as pa

    source = pa.memory_map(path, "r")
    try:
        return pa.ipc.open_file(source)
    except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_stream(source)


def arrow_batches(path: str):
    """The record batches of an Arrow IPC file, in order."""
    reader = arrow_reader(path)
    if hasattr(reader, "num_record_batches"):
        return (reader.get_batch(i) for i in range(reader.num_record_batches))
    return iter(reader)


def detect_format(files: tuple[str, ...], kind: str, text_key: str, where: str, val_fraction: float = 0.0) -> str:
    """The format of ``auto`` data, from its file kind and columns.

    One text or token stream (the built-in corpus, one .txt file, a 1-D .npy array) is read as
    random windows, unless ``val_fraction`` holds part of it out: then as documents (text) or a
    packed token stream (tokens), which can be split.
    """
    windows = not val_fraction
    if kind == "builtin":
        return "windows" if windows else "text"
    if kind == "txt":
        return "windows" if len(files) == 1 and windows else "text"
    if kind == "npy":
        return "windows" if open_npy(files[0], where).ndim == 1 and windows else "tokens"
    names = columns(files[0], kind)
    if "conversations" in names:
        return "sharegpt"
    if "instruction" in names and "output" in names:
        return "alpaca"
    if "input_ids" in names:
        return "tokens"
    if text_key in names:
        return "text"
    raise DataError(f"{where} has columns {', '.join(names) or '(none)'}, which match no data format; set "
                    f"data.format, or data.text_key for plain text.")


def dataset_spec(data, init_from: str | None, path: str | None, key: str = "data.path") -> DatasetSpec:
    """Resolve a DataSection (``data``) and one of its paths into a DatasetSpec."""
    files, kind = list_files(path, key)
    long = data.builtin_document_tokens if kind == "builtin" else 0
    where = f"{key} {path!r}" if path else "the built-in corpus's long documents" if long else "the built-in corpus"
    fmt = data.format if data.format != "auto" else "text" if long else detect_format(
        files, kind, data.text_key, where, data.val_fraction)
    if fmt == "windows":
        if kind not in ("txt", "npy", "builtin") or len(files) > 1:
            raise DataError(f"data.format windows reads one .txt or 1-D .npy file, not {where}.")
        return DatasetSpec(files, kind, fmt, None, data.text_key, False, 0.0, where)
    if kind == "npy" and len(files) > 1:
        raise DataError(f"{where} holds {len(files)} .npy files; concatenate them into one token array.")
    if kind == "npy" and fmt != "tokens":
        raise DataError(f"{where} is a .npy array of token ids; use data.format tokens (or auto).")
    if kind == "builtin" and fmt != "text":
        raise DataError(f"data.format {fmt} needs data.path; the built-in corpus is plain text.")
    if kind == "txt" and fmt != "text":
        raise DataError(f"{where} holds plain text; data.format {fmt} needs .jsonl, .json, .parquet or .arrow rows.")
    names = columns(files[0], kind) if kind in ("jsonl", "json", "parquet", "arrow") else []
    need = {"text": [data.text_key] if names else [], "alpaca": ["instruction", "output"],
            "sharegpt": ["conversations"], "tokens": ["input_ids"] if names else []}[fmt]
    missing = [c for c in need if c not in names]
    if missing:
        raise DataError(f"{where} lacks the column(s) {', '.join(missing)} that data.format {fmt} reads "
                        f"(it has {', '.join(names) or 'none'}).")
    has_labels = fmt in ("alpaca", "sharegpt") or any(c in names for c in LABEL_COLUMNS) or (
        kind == "npy" and open_npy(files[0], where).ndim == 2)
    tokenizer = data.tokenizer or (init_from if is_tokenizer_dir(init_from) else None)
    if fmt == "tokens":
        tokenizer = None
    return DatasetSpec(files, kind, fmt, tokenizer and os.path.abspath(tokenizer), data.text_key, has_labels,
                    data.val_fraction, where, long)


def run_tokenizer(data: dict, init_from: str | None) -> str | None:
    """The tokenizer a run's text was tokenized with, from its config (``data`` as a dict, as in a
    run's config.json): a tokenizer directory, BYTE_LEVEL, or None where the data are token ids
    that no configured tokenizer explains (or data.path can no longer be read to tell)."""
    named = data.get("tokenizer") or (init_from if is_tokenizer_dir(init_from) else None)
    if named:
        return named
    try:
        files, kind = list_files(data.get("path"), "data.path")
        fmt = data.get("format") or "auto"
        if fmt == "auto":
            fmt = detect_format(files, kind, data.get("text_key") or "text", "data.path",
                                data.get("val_fraction") or 0.0)
    except (DataError, OSError, ValueError):
        return None
    return None if fmt == "tokens" or kind == "npy" else BYTE_LEVEL


def fingerprint(p: DatasetSpec) -> str:
    """Cache key: files (path, size, mtime), format, tokenizer files, split, the built-in documents' length."""
    try:
        stats = [(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in p.files]
    except FileNotFoundError as e:
        raise DataError(f"{p.where}: its file {e.filename} is gone; restore it, or point data.path at the "
                        "data meant.") from None
    key = json.dumps({"v": CACHE_VERSION, "files": stats, "kind": p.kind, "format": p.format,
                      "tokenizer": tokenizer_fingerprint(p.tokenizer), "text_key": p.text_key,
                      "labels": p.has_labels, "val": p.val_fraction,
                      **({"document_tokens": p.document_tokens} if p.document_tokens else {})}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:20]


def is_val(doc: np.ndarray, fraction: float) -> np.ndarray:
    """doc: [n] document indices -> [n] bool, True for held-out ones (a fixed splitmix64 hash)."""
    with np.errstate(over="ignore"):
        z = doc.astype(np.uint64) + np.uint64(SPLIT_SALT)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53) < fraction
