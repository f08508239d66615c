"""The files of checkpoints and model directories: one atomic writer, one safetensors header check, checksums.

**Writing.** Every file a checkpoint or an export holds goes through :func:`write_file`: the bytes go
to a temporary ``.<name>.tmp-<random>`` in the same directory (so the rename cannot cross
filesystems), are fsynced, get the mode a plain ``open`` would give (0o666 less the umask), and the
file is renamed over its final name, then the directory is fsynced. A reader sees the old file or
the whole new one, never part of one; a failed write removes its temporary file before raising.
Safetensors files are written straight from the tensors' memory (:func:`write_safetensors`), and a
set of tensors as ``<prefix>-0000k-of-0000n.safetensors`` shards plus an index (:func:`write_shards`).

**Checksums.** While the bytes are written, a second thread computes their CRC-32 (the write and
zlib both release the GIL, so the two overlap); the caller keeps it (a checkpoint's meta.json), and
:func:`verify` recomputes it later, so a bit that changed on disk is caught even where the file's
size did not change. CRC-32 rather than a cryptographic hash: it guards against corruption, not
tampering, and it is fast. Measured on this project's development CPU (an Intel Xeon at 2.8 GHz,
16 MiB chunks, CPU time of one thread): CRC-32 3.1 GB/s, SHA-256 1.1 GB/s, BLAKE2b 0.64 GB/s. A 7B
checkpoint (7.6e9 parameters x 12 bytes = 91 GB) therefore costs ~29 s of one core for its checksums
(BLAKE2b would cost ~140 s): while it is written, on a second thread, hidden behind a disk that writes
under 3 GB/s; on resume or export, 29 s of CPU spread over the shards on every core, on top of
reading the 91 GB back once (the disk's time: ~30 s at 3 GB/s).

**Reading.** :func:`read_header` is the one check of a safetensors file before its tensors are
read: header length, JSON, dtypes, shapes that match their byte ranges, ranges that tile the data
exactly to the end of the file (a truncated or padded file fails here, in microseconds).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import uuid
import zlib
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CorruptFile, WriteError  # noqa: F401  (re-exported for io's modules)

CHUNK_BYTES = 64 * 2**20
"""Bytes per write (and per checksum update): large enough for full-speed I/O, small enough that
the checksum thread keeps pace one chunk behind the writer."""
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8"}
"""The torch dtypes megatrain-ray writes, and their safetensors names."""
TORCH_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
            "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "E8M0": 1}
"""Bytes per element of each safetensors dtype a header may name."""
MAX_HEADER_BYTES = 100 * 2**20


# ---------------------------------------------------------------------------------------------
# Writing.

@dataclass(frozen=True)
class FileRecord:
    """What a checkpoint remembers of one of its files, to check it later."""

    size: int
    crc32: str
    """CRC-32 of the whole file, 8 hex digits."""

    def to_dict(self) -> dict:
        return {"bytes": self.size, "crc32": self.crc32}


@dataclass(frozen=True)
class TensorSource:
    """One tensor to write: name, shape and dtype up front (for the header), its data when written."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]
    """Called once, when the tensor's bytes are written; a view of memory that exists is not copied."""
    done: Callable[[], None] | None = None
    """Called once every byte of the tensor is written and checksummed (its memory may change then)."""

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, done: Callable[[], None] | None = None) -> "TensorSource":
        return cls(name, tuple(tensor.shape), tensor.dtype, lambda: tensor, done)

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def write_file(path: str, chunks: Iterable) -> FileRecord:
    """Write ``chunks`` (bytes-like objects, in order) to ``path`` atomically; returns size and CRC-32.

    A callable among the chunks is called once every byte before it has been written (handed to the
    kernel) and checksummed: the memory those bytes came from may change from then on.

    See the module docstring; an OSError (full disk, read-only filesystem) propagates after the
    temporary file is removed.
    """
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    crc, size, pending = [0], 0, deque()

    def update(data) -> None:
        crc[0] = zlib.crc32(data, crc[0])

    try:
        with ThreadPoolExecutor(1) as hasher, open(tmp, "wb") as f:
            for chunk in chunks:
                if callable(chunk):
                    while pending:
                        pending.popleft().result()
                    chunk()
                    continue
                view = memoryview(chunk).cast("B")
                for start in range(0, len(view), CHUNK_BYTES):
                    part = view[start:start + CHUNK_BYTES]
                    pending.append(hasher.submit(update, part))
                    f.write(part)
                    size += len(part)
                    while len(pending) > 2:  # bounded: a loaded tensor is not kept for the checksum
                        pending.popleft().result()
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, new_file_mode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)
    return FileRecord(size, f"{crc[0]:08x}")


def write_json(path: str, data: Any) -> FileRecord:
    """``data`` as indented JSON at ``path``, through :func:`write_file`."""
    return write_file(path, [json.dumps(data, indent=2).encode()])


def write_safetensors(path: str, tensors: list[TensorSource], metadata: dict | None = None) -> FileRecord:
    """One safetensors file of ``tensors``, each loaded when its turn comes and written from its memory.

    The format: an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
    offsets), padded with spaces to 8 bytes, then the raw bytes in order.
    """
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for t in tensors:
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {t.name} has dtype {t.dtype}, which is not written")
        header[t.name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)

    def chunks():
        yield len(raw).to_bytes(8, "little") + raw
        for t in tensors:
            value = t.load()
            if tuple(value.shape) != t.shape or value.dtype != t.dtype:
                raise ValueError(f"tensor {t.name} is {tuple(value.shape)} {value.dtype}, not the "
                                 f"{t.shape} {t.dtype} its header says")
            yield value.contiguous().view(-1).view(torch.uint8).numpy().data
            if t.done is not None:
                yield t.done

    return write_file(path, chunks())


def write_shards(directory: str, prefix: str, index_name: str, tensors: Iterable[TensorSource],
                 shard_bytes: int) -> tuple[dict[str, str], dict[str, FileRecord]]:
    """``tensors`` in order as ``<prefix>-0000k-of-0000n.safetensors`` files of at most ``shard_bytes``
    (a larger tensor gets a file of its own) plus the index ``index_name`` ({"metadata": {"total_size"},
    "weight_map": {tensor: file}}), written last; returns (weight map, {file name: record})."""
    groups: list[list[TensorSource]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    weight_map, records = {}, {}
    for g, group in enumerate(groups):
        filename = f"{prefix}-{g + 1:05d}-of-{len(groups):05d}.safetensors"
        records[filename] = write_safetensors(os.path.join(directory, filename), group)
        weight_map.update({t.name: filename for t in group})
    total = sum(t.nbytes for group in groups for t in group)
    records[index_name] = write_json(os.path.join(directory, index_name),
                                     {"metadata": {"total_size": total}, "weight_map": weight_map})
    return weight_map, records


@contextlib.contextmanager
def atomic_dir(out: str, what: str, nbytes: int):
    """``with atomic_dir(out, what, nbytes) as tmp:`` write a directory's files into ``tmp``; when the
    block completes, ``tmp`` is renamed to ``out`` (an empty ``out`` is replaced) and the parent fsynced.

    ``tmp`` is ``<out>.tmp-<random>`` beside ``out``. If ``out``'s parent cannot be written, or holds
    less than ``nbytes`` free, nothing is written; if a write fails (a full disk), ``tmp`` is removed.
    Either way one WriteError names ``what`` (how the caller's user knows the path: ``--out``, "the
    final weights"), the path, and the space needed and free.
    """
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    tmp = f"{out}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(tmp)
    except OSError as e:
        raise WriteError(f"{what} cannot be written to {out} ({e.strerror or e}); choose a writable "
                         "directory.") from None
    try:
        free = free_bytes(parent)
        if nbytes > free:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        yield tmp
        os.rename(tmp, out)
        fsync_dir(parent)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        space = (f"; they need {fmt_bytes(nbytes)} and {fmt_bytes(free_bytes(parent))} is free there"
                 if e.errno in (errno.ENOSPC, errno.EDQUOT) else "")
        raise WriteError(f"could not write {what} to {out} ({e.strerror or e}){space}; nothing was left "
                         "behind.") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def replacing(*dirs: str):
    """``with replacing(d, ...):`` write directories anew where earlier ones may be (a resumed run's
    final weights): each existing ``d`` is moved aside first, removed once the block completes, and
    put back if the block raises, so a failed write never leaves the run without them."""
    aside = {}
    for d in dirs:
        if os.path.exists(d):
            aside[d] = f"{d}.old-{uuid.uuid4().hex[:8]}"
            os.rename(d, aside[d])
    try:
        yield
    except BaseException:
        for d, old in aside.items():
            if os.path.exists(d):
                shutil.rmtree(d, ignore_errors=True)
            os.rename(old, d)
        raise
    for old in aside.values():
        shutil.rmtree(old, ignore_errors=True)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def new_file_mode() -> int:
    """The mode ``open`` gives a new file: 0o666 less this process's umask (read without changing it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def fmt_bytes(n: float) -> str:
    """Bytes in binary units for messages: 512 B, 3.0 KiB, ..., 1.2 TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def free_bytes(path: str) -> int:
    """Free bytes on the filesystem of ``path``, or of its nearest existing parent."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


# ---------------------------------------------------------------------------------------------
# Reading and checking.

def read_header(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (safetensors dtype, shape)} of a safetensors file, after checking that its header
    describes its bytes exactly (see the module docstring); a CorruptFile says what is wrong."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little")
            if len(head) < 8 or n > min(size - 8, MAX_HEADER_BYTES):
                raise CorruptFile(f"it is {size} bytes, too short for the header it starts with")
            header = json.loads(f.read(n))
    except CorruptFile:
        raise
    except OSError as e:
        raise CorruptFile(e.strerror or str(e)) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptFile(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CorruptFile("its header is not a JSON object")
    out, ranges = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            numel = 1
            for d in shape:
                numel *= int(d)
        except (KeyError, TypeError, ValueError):
            raise CorruptFile(f"its header entry for {name} is malformed") from None
        if dtype not in ITEMSIZE:
            raise CorruptFile(f"tensor {name} has the unknown dtype {dtype}")
        if end - start != numel * ITEMSIZE[dtype]:
            raise CorruptFile(f"tensor {name}'s byte range does not fit its shape {list(shape)} of {dtype}")
        out[name] = (dtype, shape)
        ranges.append((start, end))
    data = size - 8 - n
    at = 0
    for start, end in sorted(ranges):
        if start != at:
            raise CorruptFile("its tensors' byte ranges overlap or leave gaps")
        at = end
    if at != data:
        raise CorruptFile(f"its header describes {at} bytes of tensors but the file holds {data} "
                          f"({'cut short' if data < at else 'extra bytes'})")
    return out


def checksum(path: str) -> FileRecord:
    """Size and CRC-32 of a file as it is on disk now."""
    crc, size = 0, 0
    buf = bytearray(CHUNK_BYTES // 4)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(memoryview(buf)[:n], crc)
            size += n
    return FileRecord(size, f"{crc:08x}")


def check_sizes(directory: str, records: dict[str, dict]) -> None:
    """Every recorded file exists with its recorded size (stat only); a CorruptFile names the first that does not."""
    for name, rec in sorted(records.items()):
        path = os.path.join(directory, name)
        try:
            size = os.path.getsize(path)
        except OSError:
            raise CorruptFile(f"{name} is missing") from None
        if size != rec["bytes"]:
            raise CorruptFile(f"{name} is {size} bytes but was written with {rec['bytes']} "
                              f"({'cut short' if size < rec['bytes'] else 'bytes added'})")


def verify(directory: str, records: dict[str, dict], threads: int | None = None) -> None:
    """Recompute the CRC-32 of every recorded file (on ``threads`` threads, default one per CPU);
    a CorruptFile names the first file whose bytes changed."""
    check_sizes(directory, records)
    names = sorted(records, key=lambda n: -records[n]["bytes"])
    workers = max(1, min(len(names), threads or len(os.sched_getaffinity(0))))
    with ThreadPoolExecutor(workers) as pool:
        found = dict(zip(names, pool.map(lambda n: checksum(os.path.join(directory, n)), names)))
    for name in sorted(records):
        if found[name].crc32 != records[name]["crc32"]:
            raise CorruptFile(f"{name} does not match the checksum written with it (crc32 {found[name].crc32}, "
                              f"written {records[name]['crc32']}) although its size does: its bytes changed on disk")
