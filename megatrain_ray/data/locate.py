"""Where in the data files a failed tokenization went wrong: the file and line (or row) of the
first record that cannot be read or encoded.

The tokenizer pool (:mod:`megatrain_ray.data.prepare`) sees batches, not positions in files, and
Ray Data's readers report a broken JSON line as a byte offset inside a block. Only once the
tokenization has failed, the driver reads the files again in order here, stopping at the first bad
record, so the user reads ``data.path 'docs.jsonl' line 5001: ...`` instead of a traceback; the
successful path never pays for it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator

from ..errors import DataError


def first_bad_record(where: str, files: tuple[str, ...], kind: str,
                     encode: Callable[[dict], object] | None = None) -> str | None:
    """``<where> line N: <why>`` (``row N`` outside .jsonl; ``<where>: '<file>' line N`` for several
    files) of the first record of ``files`` that is not valid JSON, not an object, or that ``encode``
    refuses with a DataError; None if every one reads."""
    for path in files:
        name = os.path.basename(path) if len(files) > 1 else None
        unit = "line" if kind == "jsonl" else "row"
        for n, row, broken in _records(path, kind):
            at = f"{where}: {name!r} {unit} {n}" if name else f"{where} {unit} {n}"
            if broken is not None:
                return f"{at} is not valid JSON ({broken})"
            if not isinstance(row, dict):
                return f"{at} is not a JSON object"
            try:
                if encode is not None:
                    encode(row)
            except DataError as e:
                return f"{at}: {e}"
    return None


def _records(path: str, kind: str) -> Iterator[tuple[int, dict | None, str | None]]:
    """(1-based line or row number, record or None, why it is not JSON or None) of one file."""
    if kind == "jsonl":
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield n, json.loads(line), None
                except ValueError as e:
                    yield n, None, getattr(e, "msg", str(e))
                    return
    elif kind == "json":
        with open(path, encoding="utf-8", errors="replace") as f:
            data = json.load(f)
        for n, row in enumerate(data if isinstance(data, list) else [data], 1):
            yield n, row, None
    elif kind in ("parquet", "arrow"):
        import pyarrow.parquet as pq

        from .datasets import arrow_batches

        batches = pq.ParquetFile(path).iter_batches(batch_size=1024) if kind == "parquet" else arrow_batches(path)
        n = 0
        for batch in batches:
            for row in batch.to_pylist():
                n += 1
                yield n, row, None
