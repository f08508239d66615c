"""Preparing a resolved dataset (:mod:`megatrain_ray.data.datasets`) into a corpus on disk: read
local files with Ray Data, tokenize in a pool of CPU actors, write the cache.

Tokenization runs as ``map_batches`` over an actor pool of ``data.num_workers`` actors (each
loads the tokenizer once) with Ray Data's streaming executor, whose bounded queues give
backpressure from the cache writer back to the file readers. The built-in corpus (~110 KB, or its
long documents, generated first: :func:`long_documents`) is tokenized in the calling process, so
are ``.arrow`` files (Arrow IPC, which Ray Data does not read; token rows are copied), and a
``.npy`` array is used in place. Order is preserved, so the corpus depends only on the files and
the tokenizer, never on the pool size. The corpus lives in ``<cache root>/<fingerprint>/``, keyed
by the files' paths, sizes and mtimes, the format, the tokenizer's files and the split
(:func:`~megatrain_ray.data.datasets.fingerprint`), and is written to a temporary directory and
renamed when complete; a later run (or a resumed one) reuses it without tokenizing again.
A pool that makes no progress after one of its actors died is stopped in one sentence
(:mod:`megatrain_ray.data.watchdog`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict

import numpy as np

from ..errors import DataError, MegatrainError
from ..progress import still
from .datasets import CACHE_VERSION, CorpusRef, DatasetSpec, arrow_batches, fingerprint, is_val
from .locate import first_bad_record
from .tokenizer import as_token_ids, load_tokenizer, messages_from_row



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


def prepare(p: DatasetSpec, cache_root: str, num_workers: int, connect: Callable[[], None] | None = None,
            log=print, *, stall_s: float) -> CorpusRef:
    """The corpus of a dataset: a .npy array in place, else the cache, tokenizing first if it is missing.

    ``stall_s`` (cluster.actor_timeout_s): how long the actor pool may write no block, once one of
    its actors died, before the step is stopped (:mod:`megatrain_ray.data.watchdog`)."""
    if p.format == "windows":
        raise ValueError("windows data is read directly by data.BatchSource, not prepared")
    if p.kind == "npy":
        return CorpusRef(p.files[0], p.layout, fingerprint(p), 0, p.val_fraction, p.where)
    fp = fingerprint(p)
    final = os.path.join(os.path.abspath(cache_root), fp)
    if not os.path.isfile(os.path.join(final, "meta.json")):
        tok = None if p.format == "tokens" else load_tokenizer(p.tokenizer)  # a broken one fails here, not in the pool
        os.makedirs(cache_root, exist_ok=True)
        _remove_unfinished(cache_root, log)
        tmp = f"{final}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            writer = CacheWriter(tmp, p.val_fraction, p.has_labels)
            if p.kind == "arrow":
                _write_arrow(p, writer)
            elif p.kind in ("builtin", "builtin-val"):
                if p.document_tokens:
                    log(f"data: generating and tokenizing {p.where} ({p.document_tokens:,}+ tokens each), once: "
                        f"the cache is {final}")
                _write_builtin(p, writer)
            else:
                if connect is not None:
                    connect()
                log(f"data: tokenizing {p.where} with {num_workers} tokenizer actor(s), once: the cache is "
                    f"{final}")
                with still(log, "data: tokenizing", detail=lambda: f", {writer.docs:,} documents written"):
                    _write_ray_data(p, writer, num_workers, stall_s)
            splits = writer.close()
            if fingerprint(p) != fp:  # written to while it was read: the cache would hold neither version
                raise DataError(f"{p.where} changed while it was being tokenized (a file's size or modification "
                                "time differs from when tokenizing began), so its cache was not kept; train "
                                "again once nothing writes to it.")
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


def _remove_unfinished(cache_root: str, log) -> None:
    """Remove the temporary caches (``<fingerprint>.tmp-<pid>``) of processes that are gone: a run
    killed (-9, a lost node) while it tokenized leaves its half-written cache behind."""
    import psutil

    for name in sorted(os.listdir(cache_root)):
        m = re.fullmatch(r"[0-9a-f]+\.tmp-(\d+)", name)
        if m and not psutil.pid_exists(int(m.group(1))):
            shutil.rmtree(os.path.join(cache_root, name), ignore_errors=True)
            log(f"data: removed {os.path.join(cache_root, name)}, the unfinished cache of process {m.group(1)}, "
                "which is gone")


def _write_arrow(p: DatasetSpec, writer: CacheWriter) -> None:
    """.arrow files (Arrow IPC, which Ray Data does not read), batch by batch in this process: token
    rows copied into the cache, text or chat rows tokenized. A row refused is named by its number
    (:func:`~megatrain_ray.data.locate.first_bad_record`), as a .jsonl file's line is; a file cut
    short or damaged, by the rows read before it broke off."""
    import pyarrow as pa

    work = TokenizeBatch(p.format, p.tokenizer, p.text_key, "arrow")
    for path in p.files:
        for batch in _readable_batches(p, path):
            try:
                _write_table(writer, work(pa.Table.from_batches([batch])))
            except DataError:
                found = first_bad_record(p.where, p.files, "arrow", work.encode)
                if found is None:
                    raise
                raise DataError(found if found.endswith(".") else f"{found}.") from None


def _readable_batches(p: DatasetSpec, path: str):
    """The record batches of the .arrow file ``path`` of ``p``; one that cannot be read is a DataError."""
    import pyarrow as pa

    rows, batches = 0, arrow_batches(path)
    name = f"{p.where}: {os.path.basename(path)!r}" if len(p.files) > 1 else p.where
    while True:
        try:
            batch = next(batches, None)
        except (OSError, pa.ArrowException) as e:  # cut short (a copy that did not finish) or damaged
            raise DataError(f"{name} cannot be read after its row {rows} ({e}); it is cut short or damaged: "
                            "copy it again.") from None
        if batch is None:
            return
        yield batch
        rows += batch.num_rows


def _write_builtin(p: DatasetSpec, writer: CacheWriter) -> None:
    """The built-in corpus's documents of one split, tokenized here (too small for an actor pool)."""
    import pyarrow as pa

    from .builtin import builtin_documents

    split = "val" if p.kind == "builtin-val" else "train"
    if p.document_tokens:
        docs = long_documents(split, p.document_tokens, load_tokenizer(p.tokenizer))
        values = np.concatenate(docs)
        writer.add(values, np.cumsum([0] + [len(d) for d in docs]), np.ones(len(values), np.uint8))
        return
    work = TokenizeBatch(p.format, p.tokenizer, p.text_key, p.kind)
    _write_table(writer, work(pa.table({p.text_key: builtin_documents(split)})))


def long_documents(split: str, min_tokens: int, tok) -> list[np.ndarray]:
    """The built-in corpus's long documents of one split, encoded by ``tok``: [n] int32 ids each, n >
    ``min_tokens`` (its text, then EOS). Each is :func:`~megatrain_ray.data.builtin.builtin_long_document`
    at the length in bytes that the tokenizer's bytes per token on the grammar predict (1% over),
    lengthened until it holds that many tokens: a pure function of the tokenizer and the length."""
    from .builtin import BUILTIN_LONG_DOCUMENTS, BUILTIN_LONG_VAL_DOCUMENTS, builtin_long_document

    sample = builtin_long_document(split, 0, 1 << 14)
    per_token = len(sample) / len(tok.encode_document(sample))
    docs = []
    for index in range(BUILTIN_LONG_VAL_DOCUMENTS if split == "val" else BUILTIN_LONG_DOCUMENTS):
        size = int(min_tokens * per_token * 1.01) + 64
        while len(ids := tok.encode_document(builtin_long_document(split, index, size))) <= min_tokens:
            size += int((min_tokens + 1 - len(ids)) * per_token * 1.1) + 64
        docs.append(ids)
    return docs


def _write_table(writer: CacheWriter, table) -> None:
    errors = [e for e in table.column("error").to_pylist() if e] if "error" in table.column_names else []
    if errors:
        raise DataError(errors[0])
    ids = table.column("ids").combine_chunks()
    offsets = ids.offsets.to_numpy()  # of a possibly sliced array: flatten() honours the slice, .values not
    writer.add(ids.flatten().to_numpy(), offsets - offsets[0], table.column("mask").combine_chunks().flatten().to_numpy())


def _write_ray_data(p: DatasetSpec, writer: CacheWriter, num_workers: int, stall_s: float) -> None:
    """Read with Ray Data, tokenize on an actor pool of ``num_workers``, write in document order;
    watched by a :class:`~megatrain_ray.data.watchdog.TokenizeWatchdog` (``stall_s``)."""
    import ray
    import ray.data

    from .watchdog import SeenExecutor, TokenizeWatchdog, dead_pool_actors

    ctx = ray.data.DataContext.get_current()
    logger = logging.getLogger("ray.data")
    saved = (ctx.execution_options.preserve_order, ctx.enable_progress_bars, logger.level,
             getattr(ctx, "use_datasource_v2", False), list(ctx.custom_execution_callback_classes))
    logger.setLevel(logging.WARNING)  # no per-dataset INFO lines in the run's output
    # Nothing of Ray Data's on the terminal: a failure is our one sentence (its traceback stays in the Ray
    # Data log file, whose handler is not a console stream).
    console = [h for h in logger.handlers
               if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]
    for h in console:
        h.addFilter(_silent)
    ctx.use_datasource_v2 = False  # its parquet listing step costs seconds per dataset; v1 reads the same rows
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    ctx.custom_execution_callback_classes = [*saved[4], SeenExecutor]
    pool = f"MapWorker(MapBatches({TokenizeBatch.__name__}))"  # how Ray Data names the pool's actors
    began = time.time()
    watchdog = TokenizeWatchdog(p.where, stall_s, lambda: dead_pool_actors(pool, began))
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
        with watchdog:
            for table in ds.iter_batches(batch_format="pyarrow", batch_size=None, prefetch_batches=2):
                _write_table(writer, table)
                watchdog.beat()
        watchdog.raise_if_stopped()  # an executor shut down may end the iteration as if it were complete
    except Exception as e:
        if watchdog.error is not None:  # the error it stopped the step with, as the consumer raised it
            raise watchdog.error from None
        raise _located(e, p) from None
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars, _, ctx.use_datasource_v2 = saved[:4]
        ctx.custom_execution_callback_classes = saved[4]
        logger.setLevel(saved[2])
        for h in console:
            h.removeFilter(_silent)


def _silent(record) -> bool:
    """A logging filter that drops every record (Ray Data's console lines while we tokenize)."""
    return False


def _located(e: BaseException, p: DatasetSpec) -> MegatrainError:
    """A failed tokenization as one sentence, naming the file and line of the record it failed on
    where a record is to blame (:mod:`megatrain_ray.data.locate`): a row the pool refused, or JSON
    that Ray Data could not parse."""
    fingerprint(p)  # a file that went away meanwhile is said as such
    refused = isinstance(e, DataError) and getattr(e, "cause", None) is None
    if refused or (p.kind in ("jsonl", "json") and "JSON" in str(e)):
        encode = TokenizeBatch(p.format, p.tokenizer, p.text_key, p.kind).encode if refused else None
        found = first_bad_record(p.where, p.files, p.kind, encode)
        if found is not None:
            return DataError(f"{found}.") if not found.endswith(".") else DataError(found)
    return _unwrap(e, p.where)


def _unwrap(e: BaseException, where: str) -> MegatrainError:
    """A Ray Data failure as one sentence (user errors of the pool actors arrive as rows, not here)."""
    if isinstance(e, MegatrainError) and getattr(e, "cause", None) is None:
        return e
    import ray.exceptions

    if isinstance(e, ray.exceptions.RayActorError):  # one of the pool's actors was killed or crashed
        return DataError(f"a tokenizer actor of {where} died (its process was killed or crashed) while it "
                         "tokenized, so nothing was cached; train again, which tokenizes the data anew.")
    lines = [ln for ln in str(getattr(e, "cause", None) or e).splitlines() if ln.strip()]
    return DataError(f"reading and tokenizing {where} failed ({type(e).__name__}: "
                     f"{lines[0] if lines else 'no message'}); see the Ray Data log for the traceback.")
