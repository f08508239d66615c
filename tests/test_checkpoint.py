"""Checkpoints: format, atomicity under a real crash, keep-last-K, bit-exact resume, fault recovery.

The store-level tests use real shared-memory stores without Ray. The resume test trains through
the real actor pipeline three times: A (12 straight steps, a checkpoint after every step), B (the
same run, checkpointing every 3 steps, interrupted like Ctrl-C once its step-3 checkpoint is out)
and C (``megatrain-ray train --resume`` of B's step-3 checkpoint: 3 steps + resume + 9 steps).
B's checkpoints (periodic and on interrupt) must equal A's at the same step bit for bit, so they
were taken at step boundaries, and C must end with A's weights and AdamW states bit for bit. The
fault test kills four actors of one run in turn; it too must end with A's weights.
"""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zlib

import pytest
import torch

from megatrain_ray import cli
from megatrain_ray.config import load_config
from megatrain_ray.data.corpus import CorpusSource
from megatrain_ray.data.loader import BatchSource, uses_windows
from megatrain_ray.engine.store.host_store import ParameterStore, StoreSpec
from megatrain_ray.errors import ConfigError
from megatrain_ray.io import checkpoint, files, hf_io, resume, writer
from megatrain_ray.model.precision import Precision
from megatrain_ray.model.transformer import hf_name
from megatrain_ray.orchestration.pipeline import Interrupted, train

from artifacts import read_tensors
from resolved import sink_settings
from conftest import interrupt_after_checkpoint, kill_in_turn

transformers = pytest.importorskip("transformers")




def _store(shm_dir, run_id, seed=0, master=torch.float32, **model) -> ParameterStore:
    cfg = load_config(None, [f"model.{k}={v}" for k, v in model.items()]).model
    return ParameterStore(StoreSpec(cfg, Precision(master, torch.float32), shm_dir, os.getpid(), run_id), seed)


def _weights(ps: ParameterStore) -> dict[str, torch.Tensor]:
    """Master weights by full HF name (the model's parameters, no fused views)."""
    layout = ps.store.layout
    return {hf_name(u, name): ps.store.params("master", i)[name].clone()
            for i, u in enumerate(layout.units) for name, _, _ in layout.templates[i].params}


def _fill_optimizer(ps: ParameterStore, step: int, seed: int = 5) -> None:
    gen = torch.Generator().manual_seed(seed)
    for kind in ("exp_avg", "exp_avg_sq"):
        arr = ps.store.arrays[kind]
        arr.copy_(torch.rand(arr.shape, generator=gen))
    for i in range(len(ps.store.layout.units)):
        ps.store.set_version(i, step)


# ---------------------------------------------------------------------------------------------
# Format and store round trip (no Ray).

@pytest.mark.parametrize("master", [torch.float32, torch.bfloat16])
def test_save_load_round_trip_is_exact_and_layout_independent(master, shm_dir, tmp_path):
    src = _store(shm_dir, "src", seed=0, master=master, num_hidden_layers=3, tie_word_embeddings="false")
    dst = _store(shm_dir, "dst", seed=1, master=master, num_hidden_layers=3, tie_word_embeddings="false")
    try:
        _fill_optimizer(src, step=7)
        path = writer.save(src.store, str(tmp_path / "ckpts"), 7, {"train": {"seed": 0}}, "run-x")
        assert os.path.basename(path) == "step-000007"
        assert sorted(os.listdir(tmp_path / "ckpts")) == ["step-000007"]  # no temporary left

        # Flat and layout-independent: full HF names, no padding, nothing positional.
        tensors = read_tensors(path)
        ours = _weights(src)
        hf_names = set(ours)
        assert {k for k in tensors if not k.startswith("exp_avg")} == hf_names
        assert {k for k in tensors if k.startswith("exp_avg.")} == {f"exp_avg.{k}" for k in hf_names}
        assert {k for k in tensors if k.startswith("exp_avg_sq.")} == {f"exp_avg_sq.{k}" for k in hf_names}
        meta = json.loads(open(os.path.join(path, "meta.json")).read())
        assert meta["format_version"] == checkpoint.FORMAT_VERSION and meta["step"] == 7
        assert meta["versions"] == {u: 7 for u in src.store.layout.units}
        assert meta["data"]["next_step"] == 7 and meta["run_id"] == "run-x"

        # Round trip into a store initialised differently: every byte of every kind comes back.
        assert checkpoint.load_into(dst.store, path) == 7
        assert {k: v.dtype for k, v in tensors.items() if not k.startswith("exp_avg")} == {k: master for k in ours}
        for kind in ("master", "exp_avg", "exp_avg_sq", "stream"):
            for i in range(len(src.store.layout.units)):
                assert torch.equal(src.store.block(kind, i), dst.store.block(kind, i)), (kind, i)
        assert [dst.store.version(i) for i in range(5)] == [7] * 5

        # The weights part is a Hugging Face checkpoint: transformers loads it with our values.
        model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=master)
        for name, value in model.state_dict().items():
            if name in ours:
                assert torch.equal(value, ours[name]), name
        assert set(ours) <= set(model.state_dict())
    finally:
        src.close()
        dst.close()


def test_save_refuses_a_store_that_is_not_at_a_step_boundary(shm_dir, tmp_path):
    ps = _store(shm_dir, "mixed")
    try:
        _fill_optimizer(ps, step=3)
        ps.store.set_version(1, 4)  # layers.0 already has its next update
        with pytest.raises(checkpoint.CheckpointError, match="not at a step boundary"):
            writer.save(ps.store, str(tmp_path), 3, {}, "r")
        assert os.listdir(tmp_path) == []
    finally:
        ps.close()


def test_save_waits_for_the_master_weights_of_a_split_update(shm_dir, tmp_path):
    """Between the sink's two passes of a split update a unit's stream copy and moments are at the
    next step while its master is not: a save of that step waits for the master (the state
    version), and one taken before it catches up is refused rather than written torn."""
    ps = _store(shm_dir, "split")
    try:
        _fill_optimizer(ps, step=3)
        units = range(len(ps.store.layout.units))
        for i in units:
            ps.store.set_stream_version(i, 4)  # first passes of update 4 done, second passes not
        assert [ps.store.version(i) for i in units] == [4] * len(units)
        assert [ps.store.state_version(i) for i in units] == [3] * len(units)
        with pytest.raises(checkpoint.CheckpointError, match="not at a step boundary"):
            writer.save(ps.store, str(tmp_path), 4, {}, "r", wait_s=0.2)
        assert os.listdir(tmp_path) == []

        def catch_up():
            time.sleep(0.3)
            for i in units:
                ps.store.set_state_version(i, 4)

        threading.Thread(target=catch_up).start()
        path = writer.save(ps.store, str(tmp_path), 4, {}, "r", wait_s=30)
        with open(os.path.join(path, checkpoint.META_FILE)) as f:
            meta = json.load(f)
        assert meta["step"] == 4 and set(meta["versions"].values()) == {4}
    finally:
        ps.close()


def test_a_diverged_step_lets_the_save_being_written_finish_first(shm_dir, tmp_path, monkeypatch):
    """The sink stops at a non-finite gradient norm; the save of the boundary before it (the last good
    weights, written in the background) is finished first, not left a temporary by the run's teardown."""
    import queue

    from megatrain_ray.engine.sink.gradient_sink import GradientSink
    from megatrain_ray.engine.tickets import GradTicket
    from megatrain_ray.errors import PipelineError

    write = writer.CheckpointWriter._write

    def slow_write(self, *args, **kwargs):  # a save that outlasts the step after it
        time.sleep(1.0)
        return write(self, *args, **kwargs)

    monkeypatch.setattr(writer.CheckpointWriter, "_write", slow_write)
    ps = _store(shm_dir, "diverge")
    root = str(tmp_path / "ckpts")
    grad_q, stats_q = queue.Queue(), queue.Queue()
    settings = sink_settings(load_config(None, ["optim.lr=1e-3", "train.steps=3"]), timeout_s=30, optimizer_threads=1)
    sink = GradientSink(ps.spec, settings, grad_q, stats_q,
                        checkpoint=checkpoint.CheckpointSettings(root, every=1, keep=2, run_config={}, run_id="r"))
    try:
        units = range(len(ps.store.layout.units))
        for step, sq_norm in ((0, 1.0), (1, float("inf"))):
            for i in units:
                grad_q.put(GradTicket(i, step, sq_norm / len(units)))
        with pytest.raises(PipelineError, match="gradient norm of step 2 is inf; training diverged"):
            sink.run(0, 3)
        assert os.listdir(root) == ["step-000001"]
        meta = checkpoint.read_meta(os.path.join(root, "step-000001"))
        assert meta["step"] == 1 and set(meta["versions"].values()) == {1}
        notices = [stats_q.get_nowait() for _ in range(stats_q.qsize())]
        assert [n["step"] for n in notices if "checkpoint" in n] == [1]
    finally:
        sink.close()
        ps.close()


def test_keep_last_k_prunes_only_after_a_new_checkpoint_is_complete(shm_dir, tmp_path):
    ps = _store(shm_dir, "keep")
    root = str(tmp_path / "ckpts")
    checkpoints = checkpoint.CheckpointSettings(root, every=1, keep=2, run_config={}, run_id="r")
    try:
        for step in range(1, 6):
            _fill_optimizer(ps, step=step)
            writer.CheckpointWriter(ps.store, checkpoints).save(step)
            kept = sorted(os.listdir(root))
            assert kept == [f"step-{s:06d}" for s in range(max(1, step - 1), step + 1)], kept
        assert checkpoint.latest(root).endswith("step-000005")
        assert resume.find(str(tmp_path / "ckpts")).endswith("step-000005")
    finally:
        ps.close()


SNAPSHOT_MODEL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=8, num_attention_heads=4,
                      vocab_size=4000)
"""2.8M parameters, 10 units: a checkpoint of 33 MB in several shards, whose files, fsyncs and rename
outlast the in-place updates the test makes as soon as each unit is released."""


@pytest.mark.parametrize("clip,staging", [(True, 0), (False, 0), (False, 2**30), (True, 5 * 2**20)])
def test_a_checkpoint_written_while_the_sink_updates_equals_one_taken_paused(shm_dir, tmp_path, clip, staging):
    """The sink's background save: every unit is changed (all three kinds) the moment before_update
    lets it, in the order the sink updates (forward order with clipping, backward without), while
    the rest is still being written. The result must be the paused save of the same boundary, bit
    for bit and byte for byte, and pass its checksums; and the updates really overlapped the write.
    With a staging budget, units the writer has not begun are copied and written from the copy."""
    ps = _store(shm_dir, f"snap{int(clip)}{int(bool(staging))}", **SNAPSHOT_MODEL)
    try:
        _fill_optimizer(ps, step=3)
        n = len(ps.store.layout.units)
        order = list(range(n)) if clip else list(range(n))[::-1]
        paused = writer.CheckpointWriter(ps.store, checkpoint.CheckpointSettings(
            str(tmp_path / "paused"), every=1, keep=1, run_config={}, run_id="r"), shard_bytes=4 * 2**20)
        path_paused = paused.save(3)
        live = writer.CheckpointWriter(ps.store, checkpoint.CheckpointSettings(
            str(tmp_path / "live"), every=1, keep=1, run_config={}, run_id="r", staging_bytes=staging),
            shard_bytes=4 * 2**20)
        live.start(3, order)
        overlapped = 0
        for i in order:
            live.before_update(i)
            overlapped += live.busy  # the write is still going on while this unit changes
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                ps.store.block(kind, i).add_(1.0)
            ps.store.set_version(i, 4)
        notice = live.finish()
        assert notice["step"] == 3 and notice["stall_s"] >= 0
        unit_bytes = [sum(ps.store.block(k, i).nbytes for k in ("master", "exp_avg", "exp_avg_sq")) for i in order]
        if staging:  # units the writer had not begun were copied, within the budget
            assert 0 < notice["staged_bytes"] <= min(staging, sum(unit_bytes))
        else:
            assert notice["staged_bytes"] == 0
        assert overlapped >= 1, overlapped  # (how many depends on the machine's load: at least one)
        ours, theirs = read_tensors(notice["checkpoint"]), read_tensors(path_paused)
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
        moved = hf_name("layers.0", "mlp.up_proj.weight")
        assert torch.equal(ps.store.params("master", 1)["mlp.up_proj.weight"], ours[moved] + 1.0)  # it did change
        checkpoint.check_files(notice["checkpoint"])  # sizes, headers and CRC-32s as written
        if clip:  # the same order as the paused save: the same bytes in every shard
            for name in os.listdir(path_paused):
                if name.endswith(".safetensors"):
                    assert files.checksum(os.path.join(path_paused, name)) == \
                        files.checksum(os.path.join(notice["checkpoint"], name)), name
        assert live.poll() is None  # reported once
    finally:
        ps.close()


def test_the_staging_budget_is_a_checked_setting_counted_by_plan():
    with pytest.raises(ConfigError, match=r"^train\.checkpoint_staging_gib must be >= 0"):
        load_config(None, ["train.checkpoint_staging_gib=-1"])
    from resolved import planned

    rows = planned(load_config(None, ["train.checkpoint_staging_gib=1.5"]), "cpu", starts_ray=False).rows
    assert [(r.where, r.nbytes) for r in rows if "train.checkpoint_staging_gib" in r.component] == \
        [("host", int(1.5 * 2**30))]


def test_a_failed_background_save_frees_the_sink_and_is_raised_once(shm_dir, tmp_path):
    """A write that fails (here: the checkpoint directory is a file) releases every unit, so the
    sink never hangs, and its one-sentence error comes out of finish()."""
    ps = _store(shm_dir, "snapfail")
    try:
        _fill_optimizer(ps, step=2)
        (tmp_path / "ckpts").write_text("not a directory")
        w = writer.CheckpointWriter(ps.store, checkpoint.CheckpointSettings(
            str(tmp_path / "ckpts"), every=1, keep=1, run_config={}, run_id="r"))
        w.start(2)
        for i in range(len(ps.store.layout.units)):
            w.before_update(i)
        with pytest.raises(checkpoint.CheckpointError, match=r"^could not write the checkpoint of step 2 to .*ckpts "):
            w.finish()
        assert w.finish() is None
    finally:
        ps.close()


def _flip_exponent_bit(directory, name: str = "model.embed_tokens.weight") -> str:
    """Flip the top exponent bit of the first float of tensor ``name`` in its shard, in place; returns the shard."""
    (shard,) = [f for f in os.listdir(directory) if f.startswith("model-") and f.endswith(".safetensors")]
    path = os.path.join(directory, shard)
    raw = bytearray(open(path, "rb").read())
    n = int.from_bytes(raw[:8], "little")
    start = json.loads(raw[8:8 + n])[name]["data_offsets"][0]
    raw[8 + n + start + 3] ^= 0x40  # byte 3 of a little-endian float32 holds the sign and top exponent bits
    with open(path, "r+b") as f:
        f.write(raw)
    return shard


def test_every_file_has_its_size_and_crc32_and_a_flipped_bit_is_refused(shm_dir, tmp_path):
    ps = _store(shm_dir, "crc")
    try:
        _fill_optimizer(ps, step=3)
        path = writer.save(ps.store, str(tmp_path / "ckpts"), 3, {"train": {"steps": 10}}, "r")
    finally:
        ps.close()
    meta = checkpoint.read_meta(path)
    assert sorted(meta["files"]) == sorted(n for n in os.listdir(path) if n != "meta.json")
    for name, rec in meta["files"].items():
        data = open(os.path.join(path, name), "rb").read()
        assert rec == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name
    checkpoint.check_files(path)
    shard = _flip_exponent_bit(path)
    assert os.path.getsize(os.path.join(path, shard)) == meta["files"][shard]["bytes"]
    checkpoint.check_files(path, checksums=False)  # the size and the header cannot see it ...
    with pytest.raises(checkpoint.CheckpointError) as info:  # ... the checksum does
        checkpoint.check_files(path)
    assert str(info.value) == (f"checkpoint {path} is corrupt: {shard} does not match the checksum written with it "
                               f"(crc32 {files.checksum(os.path.join(path, shard)).crc32}, written "
                               f"{meta['files'][shard]['crc32']}) although its size does: its bytes changed on "
                               "disk; use an earlier checkpoint of the run.")
    assert checkpoint.latest(str(tmp_path / "ckpts")) == path  # latest() does not recompute checksums
    with pytest.raises(checkpoint.CheckpointError, match=f"^checkpoint {path} is corrupt: {shard} does not match"):
        hf_io.export(path, str(tmp_path / "out"))  # export (and eval) check it too
    assert not os.path.exists(tmp_path / "out")


def test_resume_of_a_run_skips_corrupt_checkpoints_and_names_them(shm_dir, tmp_path):
    """Newest first: step 4 has a garbled meta.json, step 3 an empty one, step 2 a shard cut short, so
    step 1 is the newest valid one; each skipped one gets a line with its reason."""
    ps = _store(shm_dir, "fallback")
    root = tmp_path / "run" / "checkpoints"
    try:
        for step in (1, 2, 3, 4):
            _fill_optimizer(ps, step=step)
            writer.save(ps.store, str(root), step, load_config(None, []).to_dict(), "run")
    finally:
        ps.close()
    (root / "step-000004" / "meta.json").write_text('{"format": "megatrain-ray-checkpoint", "step"')
    (root / "step-000003" / "meta.json").write_text("")
    shard = root / "step-000002" / "optimizer-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:4096])
    lines = []
    cfg, directory, meta = resume.resume_config(str(tmp_path / "run"), None, [], log=lines.append)
    assert directory == str(root / "step-000001") and meta["step"] == 1
    assert [ln.split(" (")[0] for ln in lines] == [f"resume: skipped the corrupt checkpoint {root}/step-00000{s}"
                                                   for s in (4, 3, 2)]
    assert "its meta.json is not readable JSON" in lines[0] and "its meta.json is not readable JSON" in lines[1]
    assert "optimizer-00001-of-00001.safetensors is 4096 bytes but was written with " in lines[2]
    assert all(ln.endswith(f"using {root}/step-000001, the newest valid one") for ln in lines)
    assert checkpoint.latest(str(root)) == str(root / "step-000001")  # the driver's restart and its advice agree

    _flip_exponent_bit(root / "step-000001")
    with pytest.raises(checkpoint.CheckpointError) as info:
        resume.find(str(tmp_path / "run"), log=lines.append)
    message = str(info.value)
    assert message.startswith(f"--resume '{tmp_path / 'run'}' holds no valid checkpoint: {root}/step-000004 is "
                              "corrupt (its meta.json is not readable JSON")
    assert all(f"{root}/step-00000{s} is corrupt (" in message for s in (1, 2, 3, 4))
    assert "does not match the checksum written with it" in message


def test_a_format_1_checkpoint_without_checksums_still_loads(shm_dir, tmp_path):
    src, dst = _store(shm_dir, "v1-src"), _store(shm_dir, "v1-dst", seed=1)
    try:
        _fill_optimizer(src, step=2)
        path = writer.save(src.store, str(tmp_path), 2, {}, "r")
        meta = json.load(open(os.path.join(path, "meta.json")))
        del meta["files"], meta["meta_crc32"]
        meta["format_version"] = 1
        json.dump(meta, open(os.path.join(path, "meta.json"), "w"))
        assert checkpoint.read_meta(path)["files"] is None
        checkpoint.check_files(path)  # structure only: there are no checksums to compare
        assert checkpoint.load_into(dst.store, path) == 2
        assert torch.equal(src.store.arrays["master"], dst.store.arrays["master"])
    finally:
        src.close()
        dst.close()


def test_the_advice_for_the_last_checkpoint_of_a_run_is_export_not_resume(shm_dir, tmp_path):
    ps = _store(shm_dir, "advice")
    try:
        _fill_optimizer(ps, step=4)
        end = writer.save(ps.store, str(tmp_path), 4, {"train": {"steps": 4}}, "r")
        middle = writer.save(ps.store, str(tmp_path / "other"), 4, {"train": {"steps": 9}}, "r")
    finally:
        ps.close()
    assert checkpoint.advice(end) == (
        f"it is the end of the run: export its weights with `megatrain-ray export {end} --out DIR`, or train on "
        f"with `megatrain-ray train --resume {end} --set train.steps=N` (N > 4)")
    assert checkpoint.advice(middle) == f"resume with `megatrain-ray train --resume {middle}`"


_CRASH_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    from megatrain_ray.config import load_config
    from megatrain_ray.engine.store.host_store import ParameterStore, StoreSpec
    from megatrain_ray.io import writer
    from megatrain_ray.model.precision import Precision
    shm_dir, root = sys.argv[1], sys.argv[2]
    cfg = load_config(None, ["model.hidden_size=256", "model.intermediate_size=768", "model.num_hidden_layers=8",
                             "model.num_attention_heads=4", "model.vocab_size=8000"]).model  # 11M parameters
    ps = ParameterStore(StoreSpec(cfg, Precision(torch.float32, torch.float32), shm_dir, os.getpid(), "crash"), 0)
    for i in range(len(ps.store.layout.units)):
        ps.store.set_version(i, 1)
    writer.save(ps.store, root, 1, {}, "crash")
    print("saved", flush=True)
    for i in range(len(ps.store.layout.units)):
        ps.store.block("master", i).add_(1.0)
        ps.store.set_version(i, 2)
    # The parent kills this process while it writes step 2: from the third tensor on, each waits for
    # a line on stdin that never comes, once this says so (some shard bytes are on disk by then).
    tensor, served = writer.CheckpointWriter._tensor, []
    def paused(self, *args):
        served.append(1)
        if len(served) == 3:
            print("mid-save", flush=True)
        if len(served) >= 3:
            sys.stdin.readline()
        return tensor(self, *args)
    writer.CheckpointWriter._tensor = paused
    writer.save(ps.store, root, 2, {}, "crash")
    print("the save of step 2 finished before the kill", flush=True)
""")


def test_a_crash_mid_save_never_damages_the_last_good_checkpoint(tmp_path):
    root = tmp_path / "ckpts"
    store_dir = tmp_path / "store"  # the killed process cannot clean up: keep its store out of /dev/shm
    store_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _CRASH_SCRIPT, str(store_dir), str(root)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "saved"
        good = read_tensors(root / "step-000001")
        assert proc.stdout.readline().strip() == "mid-save"  # it waits there until killed
        os.kill(proc.pid, signal.SIGKILL)  # a real crash, in the middle of writing step 2
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    names = sorted(os.listdir(root))
    temps = [n for n in names if n.startswith(".step-000002.tmp-")]
    assert temps, names
    assert sum(f.stat().st_size for f in (root / temps[0]).iterdir()) > 0  # it had begun writing tensors
    assert not os.path.isfile(root / temps[0] / "meta.json")  # the partial save is not a checkpoint
    # Readers see step 1, bit for bit as it was saved, and it loads.
    assert resume.find(str(root)) == str(root / "step-000001")
    after = read_tensors(root / "step-000001")
    assert after.keys() == good.keys() and all(torch.equal(after[k], good[k]) for k in good)
    checkpoint.check_files(str(root / "step-000001"))
    # The next save's pruning removes the dead saver's temporary directory.
    checkpoint.prune(str(root), keep=1)
    assert os.listdir(root) == ["step-000001"]


def test_the_teardown_removes_the_saves_its_killed_writers_left_and_keeps_a_live_ones(tmp_path):
    """remove_unfinished (the run's teardown, once its roles are killed): the temporary directory of a
    save whose writer's process was killed goes, once that process is gone; one whose writer still
    lives after the wait stays, and so does one of this process (a writer thread of a run without Ray)."""
    root = tmp_path / "ckpts"
    root.mkdir()
    killed, alive = (subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(2))
    try:
        for pid in (killed.pid, alive.pid, os.getpid()):
            (root / f".step-000002.tmp-{pid}-0123abcd").mkdir()
            (root / f".step-000002.tmp-{pid}-0123abcd" / "model-00001.safetensors").write_bytes(b"x" * 64)
        killed.send_signal(signal.SIGKILL)  # not waited for here: remove_unfinished waits for it to be gone
        removed = checkpoint.remove_unfinished(str(root), within=5.0)
        assert removed == [str(root / f".step-000002.tmp-{killed.pid}-0123abcd")]
        assert sorted(os.listdir(root)) == sorted(f".step-000002.tmp-{pid}-0123abcd" for pid in (alive.pid, os.getpid()))
    finally:
        for proc in (killed, alive):
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------
# Resume through the real pipeline.

STEPS = 12


def _cfg(shm_dir, run_dir, *extra):
    return load_config(None, [f"memory.shm_dir={shm_dir}", f"train.run_dir={run_dir}", "compute.device=cpu",
                              f"train.steps={STEPS}", "train.seq_len=32", "train.micro_batch_size=4",
                              "optim.warmup_steps=2", "optim.weight_decay=0.1", "cluster.actor_timeout_s=120",
                              *extra])


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def straight_run(ray_cluster, tmp_path_factory, shm_dirs):
    """A: 12 steps straight through, a checkpoint after every step (all kept)."""
    base = tmp_path_factory.mktemp("straight")
    with shm_dirs() as shm_dir:
        a = train(_cfg(shm_dir, base / "a", "train.checkpoint_every=1", f"train.keep_checkpoints={STEPS}"),
                  log=lambda line: None)
        assert os.listdir(shm_dir) == []
    return a


def test_interrupt_and_resume_give_the_same_weights_bit_for_bit(straight_run, shm_dir, tmp_path):
    a = straight_run
    a_ckpts = os.path.join(a.run_dir, "checkpoints")
    assert sorted(os.listdir(a_ckpts)) == [f"step-{s:06d}" for s in range(1, STEPS + 1)]

    # B: the same run with a checkpoint every 3 steps, interrupted (as by Ctrl-C) once step 3's is out.
    lines = []
    with pytest.raises(Interrupted) as info:
        train(_cfg(shm_dir, tmp_path / "b", "train.checkpoint_every=3", f"train.keep_checkpoints={STEPS}"),
              log=interrupt_after_checkpoint(3, lines))
    saved = info.value.checkpoint  # where the interrupt drained the steps in flight to
    meta = checkpoint.read_meta(saved)
    boundary = meta["step"]
    assert 3 <= boundary < STEPS, lines
    # The RNG record names what draws this run's batches (nothing else draws after initialisation).
    source = BatchSource if uses_windows(_cfg(shm_dir, tmp_path / "b")) else CorpusSource
    assert meta["rng"]["data_order"] == source.ORDER and meta["rng"]["draws_after_init"] == 0
    assert os.listdir(shm_dir) == []
    b_run = os.path.dirname(os.path.dirname(saved))
    b_ckpts = sorted(os.listdir(os.path.join(b_run, "checkpoints")))
    # The periodic ones (every 3 steps, by the sink) up to the boundary, and the boundary's (by the store).
    assert set(b_ckpts) == {f"step-{s:06d}" for s in (*range(3, boundary + 1, 3), boundary)}, b_ckpts
    # Every checkpoint of B (periodic, by the sink; on interrupt, by the store) equals A's at that
    # step in every tensor: both were taken with all units at the same version.
    for name in b_ckpts:
        ours = read_tensors(os.path.join(b_run, "checkpoints", name))
        theirs = read_tensors(os.path.join(a_ckpts, name))
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), name

    # C: `megatrain-ray train --resume B` continues B in its own directory from its newest checkpoint (the
    # boundary): one run, one history, bit for bit A's (weights, AdamW states, every step's row).
    b_log_before = open(os.path.join(b_run, "train.log")).read()
    assert cli.main(["train", "--resume", b_run]) == 0
    assert glob.glob(str(tmp_path / "b" / "*")) == [b_run]
    b_config = json.load(open(os.path.join(b_run, "config.json")))
    assert b_config["resumed"] == [{"checkpoint": saved, "step": boundary}] and "resumed_from" not in b_config
    b_log = open(os.path.join(b_run, "train.log")).read()
    assert b_log.startswith(b_log_before) and f"resuming from {saved} at step {boundary}" in b_log[len(b_log_before):]
    assert sorted(os.listdir(os.path.join(b_run, "checkpoints")))[-1] == f"step-{STEPS:06d}"
    rows_a, rows_b = _metrics(a.run_dir), _metrics(b_run)
    assert [r["step"] for r in rows_b] == [r["step"] for r in rows_a] == list(range(1, STEPS + 1))
    assert [(r["loss"], r["lr"], r["grad_norm"]) for r in rows_b] == [(r["loss"], r["lr"], r["grad_norm"]) for r in rows_a]
    final_a, end_a = read_tensors(a.final_dir), read_tensors(os.path.join(a_ckpts, f"step-{STEPS:06d}"))
    for ours, theirs in ((os.path.join(b_run, "final"), final_a),
                         (os.path.join(b_run, "checkpoints", f"step-{STEPS:06d}"), end_a)):
        ours = read_tensors(ours)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    # D: `--resume B/checkpoints/step-000003`, older than B's newest: B's later checkpoints stay as they are,
    # and the resumed run writes a run directory of its own, naming the checkpoint (resumed_from).
    step3 = os.path.join(b_run, "checkpoints", "step-000003")
    assert cli.main(["train", "--resume", step3]) == 0
    c_run = [d for d in glob.glob(str(tmp_path / "b" / "*")) if d != b_run]
    assert len(c_run) == 1
    c_run = c_run[0]
    assert json.load(open(os.path.join(c_run, "config.json")))["resumed_from"] == step3
    assert _metrics(b_run) == rows_b

    final_c = read_tensors(os.path.join(c_run, "final"))
    assert final_a.keys() == final_c.keys()
    assert all(torch.equal(final_a[k], final_c[k]) for k in final_a)
    # AdamW states too, and the per-step loss and learning rate of the resumed steps.
    end_c = read_tensors(os.path.join(c_run, "checkpoints", f"step-{STEPS:06d}"))
    assert all(torch.equal(end_a[k], end_c[k]) for k in end_a)
    rows_c = _metrics(c_run)
    assert [r["step"] for r in rows_c] == list(range(4, STEPS + 1))
    assert [(r["loss"], r["lr"], r["grad_norm"]) for r in rows_c] == \
        [(r["loss"], r["lr"], r["grad_norm"]) for r in rows_a[3:]]
    # The weights really moved over the resumed steps.
    start = read_tensors(step3)
    key = hf_name("layers.0", "mlp.up_proj.weight")
    assert not torch.equal(start[key], final_c[key])

    # E: B, finished, extended in place by two steps: its rows go on, its final weights are replaced.
    assert cli.main(["train", "--resume", b_run, "--set", f"train.steps={STEPS + 2}"]) == 0
    assert [r["step"] for r in _metrics(b_run)] == list(range(1, STEPS + 3))
    assert _metrics(b_run)[:STEPS] == rows_b
    final_e = read_tensors(os.path.join(b_run, "final"))
    assert not torch.equal(final_e[key], final_a[key])
    assert torch.equal(final_e[key], read_tensors(os.path.join(b_run, "checkpoints", f"step-{STEPS + 2:06d}"))[key])
    assert sorted(os.listdir(b_run)) == sorted({"checkpoints", "config.json", "final", "metrics.jsonl", "timeline.json",
                                               "train.log"} | ({"plots"} & set(os.listdir(b_run))))
    assert os.listdir(shm_dir) == []


def test_the_benchmarks_run_interrupted_stops_without_saving_anything(ray_cluster, shm_dir, tmp_path):
    """The run `megatrain-ray bench` trains (train.checkpoint_on_interrupt=false) stopped as by Ctrl-C
    at step 2: no checkpoint is written (a benchmark's random weights are not worth the disk, nor the
    wait: 85 GiB at 7B), the interrupt says why, and the shared memory is gone."""
    from megatrain_ray import bench

    cfg = bench.bench_config(bench.base_sections("tiny", None, None, 2), 256, 32, 2, STEPS, None,
                             [f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path}", "compute.device=cpu",
                              "cluster.actor_timeout_s=120"])
    assert not cfg.train.checkpoint_on_interrupt and cfg.train.checkpoint_every == 0
    lines = []

    def log(line):
        lines.append(line)
        if re.match(r"step\s+2/", line):
            raise KeyboardInterrupt

    with pytest.raises(Interrupted) as info:
        train(cfg, log=log)
    assert info.value.checkpoint is None and info.value.note == "train.checkpoint_on_interrupt is false", lines
    assert not any(line.startswith("interrupted: finishing") for line in lines)
    (run_dir,) = tmp_path.iterdir()
    assert checkpoint.latest(str(run_dir / "checkpoints"), missing_ok=True) is None
    assert [r["step"] for r in _metrics(run_dir)][:2] == [1, 2]
    assert os.listdir(shm_dir) == []


def test_a_finished_run_is_extended_only_explicitly_with_its_schedule_recomputed(straight_run, shm_dir, tmp_path,
                                                                              capsys):
    """Resuming a run that reached train.steps is refused with how to extend it; a larger train.steps
    extends it, recomputing the cosine schedule over the new total, and the run says what that does
    to the learning rate (here: from the old schedule's last, tiny rate back up)."""
    from megatrain_ray.config import lr_at

    a = straight_run
    end = os.path.join(a.run_dir, "checkpoints", f"step-{STEPS:06d}")
    here = [f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path / 'runs'}"]
    capsys.readouterr()
    assert cli.main(["train", "--resume", a.run_dir, *sum((["--set", s] for s in here), [])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: checkpoint {end} is the end of its run (step {STEPS} of train.steps {STEPS}), so there "
                   f"is nothing to resume; to train on, extend the run explicitly with --set train.steps=N "
                   f"(N > {STEPS}), which recomputes the cosine schedule over N steps."]
    assert not os.path.exists(tmp_path / "runs")

    longer = STEPS + 4
    cfg, directory, _ = resume.resume_config(a.run_dir, None, [*here, f"train.steps={longer}"])
    lines = []
    result = train(cfg, log=lines.append, resume=directory)
    old_last, new_next = lr_at(cfg.optim, STEPS - 1, STEPS), lr_at(cfg.optim, STEPS, longer)
    assert new_next > 5 * old_last  # the recomputed schedule jumps back up: that is why it is said
    assert f"extending the run from {STEPS} to {longer} steps: the cosine schedule is recomputed over {longer} " \
           f"steps, so step {STEPS + 1} runs at lr {new_next:.2e} (step {STEPS}, the last one trained, ran at " \
           f"{old_last:.2e})" in lines
    rows = _metrics(result.run_dir)
    assert [r["step"] for r in rows] == list(range(STEPS + 1, longer + 1))
    assert [r["lr"] for r in rows] == pytest.approx([lr_at(cfg.optim, s, longer) for s in range(STEPS, longer)])
    assert _metrics(a.run_dir)[-1]["lr"] == pytest.approx(old_last)
    assert os.listdir(shm_dir) == []


def test_a_changed_step_count_or_schedule_is_said_and_an_unchanged_one_is_not():
    cfg = load_config(None, ["train.steps=60"])
    meta = {"step": 30, "config": cfg.to_dict()}
    assert checkpoint.check_resume(meta, cfg, "ckpt") is None
    shorter = load_config(None, ["train.steps=40"])
    assert checkpoint.check_resume(meta, shorter, "ckpt") == (
        "shortening the run from 60 to 40 steps: the cosine schedule is recomputed over 40 steps, so step 31 runs "
        "at lr 4.39e-04 (step 30, the last one trained, ran at 1.58e-03)")
    hotter = load_config(None, ["train.steps=60", "optim.lr=6e-3"])
    assert checkpoint.check_resume(meta, hotter, "ckpt").startswith(
        "the learning-rate schedule differs from the checkpoint's run (optim.* changed): step 31 runs at lr 3.00e-03 "
        "instead of 1.50e-03")
    with pytest.raises(ConfigError, match=r"^train.steps \(30\) is not beyond the checkpoint's step \(30\)"):
        checkpoint.check_resume(meta, load_config(None, ["train.steps=30"]), "ckpt")


@pytest.mark.slow  # kills actors and restarts the pipeline
def test_killed_actors_are_replaced_and_the_weights_are_identical(straight_run, shm_dir, tmp_path):
    """ray.kill the data loader, the compute worker, the grad sink and the prefetcher, one after another."""
    lines = []
    roles = ["data-0", "compute", "grad-sink", "prefetch"]
    result = train(_cfg(shm_dir, tmp_path, "train.checkpoint_every=1", f"train.keep_checkpoints={STEPS}",
                        "cluster.max_restarts=4"), log=kill_in_turn(roles, lines))
    killed = [ln for ln in lines if ln.startswith("killed ")]
    restarts = [ln for ln in lines if ln.startswith("restart ")]
    assert [re.match(r"killed (data-0|compute|grad-sink|prefetch)-", k).group(1) for k in killed] == roles, killed
    assert len(restarts) == 4, "\n".join(lines)
    for n, line in enumerate(restarts, 1):
        assert line.startswith(f"restart {n} of 4: the ") and " actor died" in line, line
        assert "restarting the pipeline from " in line and "/checkpoints/step-" in line, line
    final, expected = read_tensors(result.final_dir), read_tensors(straight_run.final_dir)
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in expected)
    end, end_a = (read_tensors(os.path.join(r, "checkpoints", f"step-{STEPS:06d}"))
                  for r in (result.run_dir, straight_run.run_dir))
    assert all(torch.equal(end[k], end_a[k]) for k in end_a)
    assert os.listdir(shm_dir) == []
