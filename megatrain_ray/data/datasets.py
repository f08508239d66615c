"""Preparing training data with Ray Data: read local files, tokenize in a pool of CPU actors, cache.

A dataset is planned from the ``data`` config section (:func:`plan`): its files (one file, or a
directory of files of one kind: ``.txt``, ``.jsonl``/``.json``, ``.parquet``, ``.arrow``, ``.npy``),
its format and its tokenizer. :func:`prepare` then turns it into a *corpus*: token ids in document
order on disk, memory-mapped by every data-loader actor.

- ``text``: each document (a row's ``data.text_key`` field, or a blank-line-separated paragraph
  of a ``.txt`` file) is tokenized and ends with EOS; documents are concatenated (layout
  ``packed``: fixed-length sequences are later cut from the stream).
- ``alpaca`` / ``sharegpt``: each row is one conversation, rendered with the chat template, with a
  mask of its response tokens (layout ``rows``: one example per sequence).
- ``tokens``: pre-tokenized ``input_ids`` (optionally ``labels`` with -100 or a 0/1 ``loss_mask``);
  a 1-D ``.npy`` stream or a 2-D ``.npy`` array of rows is memory-mapped in place, not copied.

Tokenization runs as ``map_batches`` over an actor pool of ``data.num_workers`` actors (each
loads the tokenizer once) with Ray Data's streaming executor, whose bounded queues give
backpressure from the cache writer back to the file readers; the built-in corpus (~110 KB) is
tokenized in the calling process. Order is preserved, so the corpus
depends only on the files and the tokenizer, never on the pool size. The corpus lives in
``<cache root>/<fingerprint>/``, keyed by the files' paths, sizes and mtimes, the format, the
tokenizer's files and the split, and is written to a temporary directory and renamed when
complete; a later run (or a resumed one) reuses it without tokenizing again.

Validation split: a document goes to ``val`` when a fixed hash of its index falls below
``data.val_fraction`` (independent of the training seed), else to ``train``; or all of
``data.val_path`` is ``val``; without either, the built-in corpus's ``val`` is its own held-out
documents (:func:`megatrain_ray.data.builtin.builtin_documents`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import DataError, MegatrainError
from .tokenizer import (BYTE_LEVEL, as_token_ids, is_tokenizer_dir, load_tokenizer, messages_from_row,
                        tokenizer_fingerprint)

CACHE_VERSION = 1
EXTENSIONS = {".txt": "txt", ".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow",
              ".npy": "npy"}
LABEL_COLUMNS = ("labels", "loss_mask")
SPLIT_SALT = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class DataPlan:
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
            return list(_arrow_reader(path).schema.names)
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


def _arrow_reader(path: str):
    import pyarrow as pa

    source = pa.memory_map(path, "r")
    try:
        return pa.ipc.open_file(source)
    except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_stream(source)


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


def plan(data, init_from: str | None, path: str | None, key: str = "data.path") -> DataPlan:
    """Resolve a DataSection (``data``) and one of its paths into a DataPlan."""
    files, kind = list_files(path, key)
    where = f"{key} {path!r}" if path else "the built-in corpus"
    fmt = data.format if data.format != "auto" else detect_format(files, kind, data.text_key, where,
                                                                  data.val_fraction)
    if fmt == "windows":
        if kind not in ("txt", "npy", "builtin") or len(files) > 1:
            raise DataError(f"data.format windows reads one .txt or 1-D .npy file, not {where}.")
        return DataPlan(files, kind, fmt, None, data.text_key, False, 0.0, where)
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
    return DataPlan(files, kind, fmt, tokenizer and os.path.abspath(tokenizer), data.text_key, has_labels,
                    data.val_fraction, where)


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


def fingerprint(p: DataPlan) -> str:
    """Cache key: files (path, size, mtime), format, tokenizer files, split."""
    stats = [(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in p.files]
    key = json.dumps({"v": CACHE_VERSION, "files": stats, "kind": p.kind, "format": p.format,
                      "tokenizer": tokenizer_fingerprint(p.tokenizer), "text_key": p.text_key,
                      "labels": p.has_labels, "val": p.val_fraction}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:20]


def is_val(doc: np.ndarray, fraction: float) -> np.ndarray:
    """doc: [n] document indices -> [n] bool, True for held-out ones (a fixed splitmix64 hash)."""
    with np.errstate(over="ignore"):
        z = doc.astype(np.uint64) + np.uint64(SPLIT_SALT)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53) < fraction


# ---------------------------------------------------------------------------------------------
# Tokenizing (the actor pool's work) and writing the cache.

class TokenizeBatch:
    """The pool actors' work: rows of a pyarrow batch -> documents (ids, mask) as list columns."""

    def __init__(self, fmt: str, tokenizer: str | None, text_key: str, kind: str):
        self.fmt, self.text_key, self.kind = fmt, text_key, kind
        self.tok = None if fmt == "tokens" else load_tokenizer(tokenizer)

    def __call__(self, table):
        import pyarrow as pa

        ids, masks, error = [], [], None
        try:
            for row in table.to_pylist():
                for doc_ids, doc_mask in self.encode(row):
                    ids.append(doc_ids)
                    masks.append(doc_mask if doc_mask is not None else np.ones(len(doc_ids), np.uint8))
        except DataError as e:  # reported by the driver (Ray would keep only its text, in a traceback)
            ids, masks, error = [], [], str(e)
        offsets = pa.array(np.cumsum([0] + [len(x) for x in ids]).astype(np.int32))
        flat = np.concatenate(ids).astype(np.int32) if ids else np.zeros(0, np.int32)
        flat_mask = np.concatenate(masks).astype(np.uint8) if masks else np.zeros(0, np.uint8)
        out = {"ids": pa.ListArray.from_arrays(offsets, pa.array(flat)),
               "mask": pa.ListArray.from_arrays(offsets, pa.array(flat_mask))}
        if error is not None:
            out = {"ids": pa.array([[]], pa.list_(pa.int32())), "mask": pa.array([[]], pa.list_(pa.uint8()))}
        out["error"] = pa.array([error] * len(out["ids"]), pa.string())
        return pa.table(out)

    def encode(self, row: dict):
        """The (ids [n] int32, mask [n] uint8 or None) documents of one input row."""
        if self.kind == "txt":
            try:
                text = row["bytes"].decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{row.get('path', 'a .txt file')} is not UTF-8 text ({e}).") from None
            return [(self.tok.encode_document(d), None) for d in text.split("\n\n") if d.strip()]
        if self.fmt == "text":
            text = row.get(self.text_key)
            if text is not None and not isinstance(text, str):
                raise DataError(f"column {self.text_key!r} must hold text, got {type(text).__name__}.")
            return [(self.tok.encode_document(text), None)] if text and text.strip() else []
        if self.fmt in ("alpaca", "sharegpt"):
            return [self.tok.encode_chat(messages_from_row(row, self.fmt))]
        ids = as_token_ids(row["input_ids"], "a row's input_ids")
        mask = None
        if row.get("labels") is not None:
            mask = (np.asarray(row["labels"]) != -100).astype(np.uint8)
        elif row.get("loss_mask") is not None:
            mask = (np.asarray(row["loss_mask"]) != 0).astype(np.uint8)
        if mask is not None and len(mask) != len(ids):
            raise DataError(f"a row's labels/loss_mask has {len(mask)} entries for {len(ids)} input_ids.")
        if ids.size and (ids.min() < 0 or ids.max() >= 2**31):
            raise DataError(f"input_ids must be non-negative 32-bit token ids, got {int(ids.min())}..{int(ids.max())}.")
        return [(ids.astype(np.int32), mask)] if ids.size else []


class CacheWriter:
    """Appends documents to the train/val files of a cache directory, in document order."""

    def __init__(self, directory: str, val_fraction: float, with_mask: bool):
        self.dir, self.val_fraction, self.with_mask = directory, val_fraction, with_mask
        self.files = {}
        self.offsets = {"train": [0], "val": [0]}
        self.max_id = {"train": -1, "val": -1}
        self.docs = 0
        for split in ("train", "val"):
            self.files[split] = [open(os.path.join(directory, f"{split}.tokens.bin"), "wb")]
            if with_mask:
                self.files[split].append(open(os.path.join(directory, f"{split}.mask.bin"), "wb"))

    def add(self, values: np.ndarray, offsets: np.ndarray, mask: np.ndarray) -> None:
        """values: [T] int32, offsets: [n + 1], mask: [T] uint8 -- n documents."""
        n = len(offsets) - 1
        held = is_val(np.arange(self.docs, self.docs + n), self.val_fraction)
        self.docs += n
        for split, chosen in (("train", ~held), ("val", held)):
            idx = np.flatnonzero(chosen)
            if idx.size == 0:
                continue
            parts = [values[offsets[i]:offsets[i + 1]] for i in idx]
            flat = np.concatenate(parts).astype(np.int32)
            flat.tofile(self.files[split][0])
            if self.with_mask:
                np.concatenate([mask[offsets[i]:offsets[i + 1]] for i in idx]).astype(np.uint8).tofile(
                    self.files[split][1])
            ends = self.offsets[split][-1] + np.cumsum([len(p) for p in parts])
            self.offsets[split].extend(int(e) for e in ends)
            if flat.size:
                self.max_id[split] = max(self.max_id[split], int(flat.max()))

    def close(self) -> dict:
        for handles in self.files.values():
            for f in handles:
                f.close()
        out = {}
        for split in ("train", "val"):
            np.save(os.path.join(self.dir, f"{split}.offsets.npy"), np.asarray(self.offsets[split], np.int64))
            out[split] = {"documents": len(self.offsets[split]) - 1, "tokens": self.offsets[split][-1],
                          "max_id": self.max_id[split]}
        return out


def prepare(p: DataPlan, cache_root: str, num_workers: int, connect: Callable[[], None] | None = None,
            log=print) -> CorpusRef:
    """The corpus of a plan: a .npy array in place, else the cache, tokenizing first if it is missing."""
    if p.format == "windows":
        raise ValueError("windows data is read directly by data.BatchSource, not prepared")
    if p.kind == "npy":
        return CorpusRef(p.files[0], p.layout, fingerprint(p), 0, p.val_fraction, p.where)
    fp = fingerprint(p)
    final = os.path.join(os.path.abspath(cache_root), fp)
    if not os.path.isfile(os.path.join(final, "meta.json")):
        tok = None if p.format == "tokens" else load_tokenizer(p.tokenizer)  # a broken one fails here, not in the pool
        os.makedirs(cache_root, exist_ok=True)
        tmp = f"{final}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            writer = CacheWriter(tmp, p.val_fraction, p.has_labels)
            if p.kind == "arrow":
                _write_arrow(p, writer)
            elif p.kind in ("builtin", "builtin-val"):
                _write_builtin(p, writer)
            else:
                if connect is not None:
                    connect()
                _write_ray_data(p, writer, num_workers)
            splits = writer.close()
            pad = 0 if tok is None else tok.pad_id
            meta = {"version": CACHE_VERSION, "plan": asdict(p), "fingerprint": fp, "layout": p.layout,
                    "pad_id": pad, "splits": splits}
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump(meta, f, indent=2)
            try:
                os.rename(tmp, final)
            except OSError:  # another process finished the same corpus first
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log(f"data: tokenized {p.where} into {final} ({splits['train']['tokens']:,} train tokens, "
            f"{splits['val']['tokens']:,} val tokens)")
    with open(os.path.join(final, "meta.json")) as f:
        meta = json.load(f)
    return CorpusRef(final, meta["layout"], fp, int(meta["pad_id"]), p.val_fraction, p.where)


def _write_arrow(p: DataPlan, writer: CacheWriter) -> None:
    """Pre-tokenized .arrow files: record batches straight into the cache (nothing to tokenize)."""
    work = TokenizeBatch("tokens", None, p.text_key, "arrow")
    for path in p.files:
        import pyarrow as pa

        reader = _arrow_reader(path)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) if hasattr(
            reader, "num_record_batches") else reader
        for batch in batches:
            _write_table(writer, work(pa.Table.from_batches([batch])))


def _write_builtin(p: DataPlan, writer: CacheWriter) -> None:
    """The built-in corpus's documents of one split, tokenized here (too small for an actor pool)."""
    import pyarrow as pa

    from .builtin import builtin_documents

    docs = builtin_documents("val" if p.kind == "builtin-val" else "train")
    work = TokenizeBatch(p.format, p.tokenizer, p.text_key, p.kind)
    _write_table(writer, work(pa.table({p.text_key: docs})))


def _write_table(writer: CacheWriter, table) -> None:
    errors = [e for e in table.column("error").to_pylist() if e] if "error" in table.column_names else []
    if errors:
        raise DataError(errors[0])
    ids = table.column("ids").combine_chunks()
    offsets = ids.offsets.to_numpy()  # of a possibly sliced array: flatten() honours the slice, .values not
    writer.add(ids.flatten().to_numpy(), offsets - offsets[0], table.column("mask").combine_chunks().flatten().to_numpy())


def _write_ray_data(p: DataPlan, writer: CacheWriter, num_workers: int) -> None:
    """Read with Ray Data, tokenize on an actor pool of ``num_workers``, write in document order."""
    import ray
    import ray.data

    ctx = ray.data.DataContext.get_current()
    logger = logging.getLogger("ray.data")
    saved = (ctx.execution_options.preserve_order, ctx.enable_progress_bars, logger.level,
             getattr(ctx, "use_datasource_v2", False))
    logger.setLevel(logging.WARNING)  # no per-dataset INFO lines in the run's output
    ctx.use_datasource_v2 = False  # its parquet listing step costs seconds per dataset; v1 reads the same rows
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    cpus = max(0.1, min(1.0, ray.available_resources().get("CPU", 1.0) / (num_workers + 1)))
    try:
        files = list(p.files)
        if p.kind == "txt":
            ds = ray.data.read_binary_files(files, include_paths=True, num_cpus=cpus)
        elif p.kind in ("json", "jsonl"):
            ds = ray.data.read_json(files, lines=p.kind == "jsonl", num_cpus=cpus)
        else:
            ds = ray.data.read_parquet(files, num_cpus=cpus)
        # max_restarts=0: Ray Data hands its actors their constructor arguments as object refs, which
        # a restart could not count on (Ray logs an error saying so for every actor of a restartable
        # pool); a tokenizer actor that dies fails the data step with one error instead. Passing it
        # is deprecated from Ray 2.60 (ray is pinned below 2.61), and that warning is not the user's.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
            ds = ds.map_batches(TokenizeBatch, fn_constructor_args=(p.format, p.tokenizer, p.text_key, p.kind),
                                batch_format="pyarrow", batch_size=64, num_cpus=cpus, max_restarts=0,
                                compute=ray.data.ActorPoolStrategy(size=num_workers))
        for table in ds.iter_batches(batch_format="pyarrow", batch_size=None, prefetch_batches=2):
            _write_table(writer, table)
    except Exception as e:
        raise _unwrap(e, p.where) from None
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars, _, ctx.use_datasource_v2 = saved
        logger.setLevel(saved[2])


def _unwrap(e: BaseException, where: str) -> MegatrainError:
    """A Ray Data failure as one sentence (user errors of the pool actors arrive as rows, not here)."""
    if isinstance(e, MegatrainError) and getattr(e, "cause", None) is None:
        return e
    lines = [ln for ln in str(getattr(e, "cause", None) or e).splitlines() if ln.strip()]
    return DataError(f"reading and tokenizing {where} failed ({type(e).__name__}: "
                     f"{lines[0] if lines else 'no message'}); see the Ray Data log for the traceback.")
