"""The one safetensors writer and the one header check (megatrain_ray.io.files), on real files.

The writer's output must be what safetensors and transformers read; a writer killed with SIGKILL
mid-file, or stopped by a full disk (a real 2 MiB tmpfs), must leave the previous file intact and
no partial one under the final name; the checksum written with a file must catch one flipped bit.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatrain_ray.io import files


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=gen), "b.bias": torch.randn(7, generator=gen).bfloat16(),
            "c": torch.randn(3, 5, generator=gen).half()}


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_written_file_is_safetensors_with_a_plain_mode_and_its_crc32(tmp_path):
    tensors = _tensors()
    path = tmp_path / "x.safetensors"
    rec = files.write_safetensors(str(path), [files.TensorSource.of(k, v) for k, v in tensors.items()])
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    data = path.read_bytes()
    assert rec == files.FileRecord(len(data), f"{zlib.crc32(data):08x}") == files.checksum(str(path))
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~_umask()
    assert os.listdir(tmp_path) == ["x.safetensors"]  # no temporary left
    assert files.read_header(str(path)) == {"a.weight": ("F32", (64, 32)), "b.bias": ("BF16", (7,)),
                                            "c": ("F16", (3, 5))}


def test_a_large_tensor_crosses_chunks_and_the_checksum_follows(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "CHUNK_BYTES", 1000)  # 64 x 32 x 4 bytes: many chunks, one odd-sized
    t = torch.arange(64 * 32 + 3, dtype=torch.float32)
    rec = files.write_safetensors(str(tmp_path / "x.safetensors"), [files.TensorSource.of("t", t)])
    assert torch.equal(load_file(tmp_path / "x.safetensors")["t"], t)
    assert rec == files.checksum(str(tmp_path / "x.safetensors"))


def test_header_check_accepts_what_safetensors_writes_and_names_each_defect(tmp_path):
    good = tmp_path / "good.safetensors"
    save_file(_tensors(), good, metadata={"format": "pt"})
    assert set(files.read_header(str(good))) == {"a.weight", "b.bias", "c"}
    data = good.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])

    def write(name: str, raw: bytes) -> str:
        (tmp_path / name).write_bytes(raw)
        return str(tmp_path / name)

    def with_header(h: dict) -> bytes:
        raw = json.dumps(h).encode()
        return len(raw).to_bytes(8, "little") + raw + data[8 + n:]

    cases = {
        "cut short": write("cut.safetensors", data[:-10]),
        "extra bytes": write("long.safetensors", data + b"\0" * 8),
        "too short for the header": write("tiny.safetensors", data[:5]),
        "not JSON": write("garbage.safetensors", len(b"{oops").to_bytes(8, "little") + b"{oops" + b"\0" * 64),
        "does not fit its shape": write("shape.safetensors", with_header(
            {**header, "c": {**header["c"], "shape": [4, 5]}})),
        "unknown dtype": write("dtype.safetensors", with_header({**header, "c": {**header["c"], "dtype": "Q7"}})),
    }
    over = dict(header)
    a, b = over["a.weight"]["data_offsets"], over["b.bias"]["data_offsets"]
    over["b.bias"] = {**over["b.bias"], "data_offsets": [a[0], a[0] + b[1] - b[0]]}
    cases["overlap or leave gaps"] = write("overlap.safetensors", with_header(over))
    for reason, path in cases.items():
        with pytest.raises(files.CorruptFile, match=reason):
            files.read_header(path)
    with pytest.raises(files.CorruptFile, match="No such file"):
        files.read_header(str(tmp_path / "absent.safetensors"))


def test_one_flipped_bit_of_the_same_size_is_caught(tmp_path):
    path = tmp_path / "x.safetensors"
    rec = files.write_safetensors(str(path), [files.TensorSource.of(k, v) for k, v in _tensors().items()])
    records = {"x.safetensors": rec.to_dict()}
    files.verify(str(tmp_path), records)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x40  # an exponent bit of the last float16
    path.write_bytes(bytes(raw))
    assert os.path.getsize(path) == rec.size
    with pytest.raises(files.CorruptFile, match="x.safetensors does not match the checksum written with it"):
        files.verify(str(tmp_path), records)
    path.write_bytes(bytes(raw[:-2]))
    with pytest.raises(files.CorruptFile, match=r"x.safetensors is \d+ bytes but was written with \d+ \(cut short\)"):
        files.verify(str(tmp_path), records)


_KILLED_WRITER = textwrap.dedent("""
    import sys, torch
    from megatrain_ray.io import files
    big = torch.ones(64 * 2**20)  # 256 MiB: the parent kills this process while it is written
    print("writing", flush=True)
    while True:
        files.write_safetensors(sys.argv[1], [files.TensorSource.of("big", big)])
""")


def test_a_writer_killed_mid_file_leaves_the_previous_file_whole(tmp_path):
    path = tmp_path / "x.safetensors"
    old = _tensors(seed=1)
    files.write_safetensors(str(path), [files.TensorSource.of(k, v) for k, v in old.items()])
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert proc.stdout.readline().strip() == "writing"
        deadline = time.monotonic() + 60
        while not any(n.startswith(".x.safetensors.tmp-") and os.path.getsize(tmp_path / n) > 2**20
                      for n in os.listdir(tmp_path)):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    loaded = load_file(path)  # still the old file, whole
    assert loaded.keys() == old.keys() and all(torch.equal(loaded[k], old[k]) for k in old)
    assert [n for n in os.listdir(tmp_path) if n != "x.safetensors"][0].startswith(".x.safetensors.tmp-")


def test_a_full_disk_keeps_the_previous_file_and_leaves_no_temporary(small_disk):
    path = small_disk / "x.safetensors"
    old = _tensors()
    files.write_safetensors(str(path), [files.TensorSource.of(k, v) for k, v in old.items()])
    big = torch.zeros(1024 * 1024)  # 4 MiB on a 2 MiB disk
    with pytest.raises(OSError) as info:
        files.write_safetensors(str(path), [files.TensorSource.of("big", big)])
    assert "No space left on device" in str(info.value)
    assert os.listdir(small_disk) == ["x.safetensors"]
    assert torch.equal(load_file(path)["a.weight"], old["a.weight"])


def test_atomic_dir_on_a_full_disk_removes_what_it_wrote_and_says_what_is_needed(small_disk):
    out = small_disk / "final"
    with pytest.raises(files.WriteError) as info:  # refused up front: more than is free
        with files.atomic_dir(str(out), "the final weights", 3 * 2**20):
            raise AssertionError("nothing may be written")
    assert str(info.value).startswith(f"could not write the final weights to {out} (No space left on device); "
                                      "they need 3.0 MiB and ")
    with pytest.raises(files.WriteError) as info:  # fills up while writing
        with files.atomic_dir(str(out), "the final weights", 2**20) as tmp:
            files.write_safetensors(os.path.join(tmp, "a.safetensors"),
                                    [files.TensorSource.of("big", torch.zeros(1024 * 1024))])
    assert "No space left on device" in str(info.value) and "nothing was left behind" in str(info.value)
    assert os.listdir(small_disk) == []
    with files.atomic_dir(str(out), "the final weights", 100) as tmp:  # and one that fits appears whole
        files.write_json(os.path.join(tmp, "config.json"), {"ok": True})
    assert os.listdir(small_disk) == ["final"] and os.listdir(out) == ["config.json"]


def test_atomic_dir_on_a_read_only_path_is_one_sentence(read_only_dir):
    ro = read_only_dir
    with pytest.raises(files.WriteError, match=rf"^--out cannot be written to {ro}/x \(Read-only file system\)"):
        with files.atomic_dir(str(ro / "x"), "--out", 10):
            raise AssertionError("nothing may be written")
