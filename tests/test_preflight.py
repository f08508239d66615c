"""Preflight: ``megatrain-ray plan`` and the up-front refusal of a run that cannot fit.

The host-store rows are checked against the segments a real store creates; an absurdly large
model is refused by ``train`` before Ray starts, with the table and one sentence, exit status 2.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from megatrain_ray import cli
from megatrain_ray.config import load_config
from megatrain_ray.engine.store.host_store import ParameterStore, StoreSpec
from megatrain_ray.model.layout import StoreLayout
from megatrain_ray.model.precision import Precision
from megatrain_ray.orchestration import machine, preflight
from megatrain_ray.orchestration import resolve as resolve_module
from megatrain_ray.orchestration.cluster import cluster_to_join
from megatrain_ray.orchestration.resolve import Facts, check, resolve
from resolved import planned

HUGE = ["--set", "model.hidden_size=16384", "--set", "model.num_hidden_layers=200", "--set",
        "model.intermediate_size=53248", "--set", "model.num_attention_heads=128", "--set", "model.vocab_size=128256"]


def _bytes(text: str) -> int:
    """'576.0 KiB' -> bytes (to the printed precision)."""
    value, unit = text.split()
    return int(float(value) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit])


def test_store_rows_match_the_segments_a_real_store_creates(shm_dir):
    cfg = load_config(None, [f"memory.shm_dir={shm_dir}", "compute.device=cpu", "model.num_hidden_layers=3"])
    plan = planned(cfg, "cpu", starts_ray=False)
    store = ParameterStore(StoreSpec(cfg.model, Precision(torch.float32, torch.float32), shm_dir, os.getpid(),
                                     "plan"), seed=0)
    try:
        sizes = {name.rsplit("-", 1)[1]: os.path.getsize(os.path.join(shm_dir, name)) for name in os.listdir(shm_dir)}
    finally:
        store.close()
    shm_rows = [r for r in plan.rows if r.where == "shm"]
    assert sum(r.nbytes for r in shm_rows) == sum(sizes.values())
    total = StoreLayout.build(cfg.model).total
    assert {r.component: r.nbytes for r in shm_rows} == {
        "master weights (float32)": sizes["master"], "AdamW exp_avg (float32)": sizes["exp_avg"],
        "AdamW exp_avg_sq (float32)": sizes["exp_avg_sq"], "gradients (host side) (float32)": sizes["grad"],
        "unit versions": sizes["versions"]}
    assert sizes["master"] == total * 4


def test_gpu_plan_has_a_bf16_stream_copy_and_a_largest_micro_batch():
    cfg = load_config(None, ["model.hidden_size=1024", "model.num_hidden_layers=8", "model.intermediate_size=2816",
                             "model.num_attention_heads=8", "model.vocab_size=32000", "train.seq_len=512"])
    plan = planned(cfg, "cuda", device_bytes=8 * 2**30, starts_ray=False)
    rows = {r.component: r for r in plan.rows}
    total = StoreLayout.build(cfg.model).total
    assert rows["stream copy (streamed to the device) (bfloat16)"].nbytes == total * 2
    assert "gradients (host side) (float32)" not in rows  # gradients travel in the stream copy
    best = plan.largest_micro_batch
    assert best and best > 0

    run = resolve(cfg, Facts("cuda", 8 * 2**30))  # as the plan resolves it
    # auto, on one GPU where it fits (from layer 0 on, more while the host's update would pace the step)
    assert run.resident_layers >= 1 and run.memory.resident == run.schedule.resident
    assert cfg.memory.resident == "auto"  # the config is as written

    def device_total(b):  # activations placed by auto for that GPU, as the run would place them
        return preflight.device_total(preflight.device_rows(cfg, "cuda", b, 8 * 2**30, run.schedule.resident))

    assert device_total(best) <= 8 * 2**30 * preflight.GPU_USABLE < device_total(best + 1)
    # Beyond one loss chunk, the device total grows linearly with the micro-batch (activations).
    assert device_total(3 * best) - device_total(2 * best) == device_total(2 * best) - device_total(best) > 0


def test_plan_prints_the_table_and_fits(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plan", "--set", "compute.device=cpu"]) == 0
    out = capsys.readouterr().out
    for component in ("master weights (float32)", "AdamW exp_avg (float32)", "weight slots (2 x largest unit)",
                      "activation checkpoints", "one layer's working set", "loss chunk", "total /dev/shm",
                      "total host RAM", "largest micro-batch that fits"):
        assert component in out, component
    assert "DOES NOT FIT" not in out
    assert re.search(r"largest micro-batch that fits: \d+ \(train.micro_batch_size is 8\)", out)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("sets,when", [
    ((), "every 100 steps, at the end and when interrupted"),
    (("train.checkpoint_every=0",), "at the end before the export and when interrupted"),
    (("train.checkpoint_on_interrupt=false",), "every 100 steps, at the end, not when interrupted"),
    (("train.checkpoint_every=0", "train.save_final=false"), "only when interrupted"),
    (("train.checkpoint_every=0", "train.save_final=false", "train.checkpoint_on_interrupt=false"), "none"),
])
def test_plan_says_when_checkpoints_are_written(sets, when, tmp_path, capsys, monkeypatch):
    """train.checkpoint_every, save_final and checkpoint_on_interrupt as the plan's checkpoint line says them
    (the settings of `megatrain-ray bench`, the last: none)."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plan", "--set", "compute.device=cpu", *sum((["--set", s] for s in sets), [])]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("checkpoints: ")]
    assert re.match(rf"checkpoints: [\d.]+ [KMG]iB each \({when}; up to 2 kept", line), line


def test_plan_of_an_absurd_model_says_it_does_not_fit(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plan", *HUGE, "--device", "cuda", "--gpu-memory", "141"]) == 2
    out, err = capsys.readouterr()
    assert "DOES NOT FIT" in out
    master = re.search(r"master weights \(float32\)\s+/dev/shm\s+([0-9.]+ \w+)", out).group(1)
    layout_total = StoreLayout.build(load_config(None, [a for a in HUGE if a != "--set"]).model).total
    assert abs(_bytes(master) - layout_total * 4) / (layout_total * 4) < 0.01  # ~2.7 TiB
    assert err.startswith("error: the run needs") and err.count("\n") == 1


def test_train_refuses_an_absurd_model_before_starting_anything(shm_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "megatrain_ray.cli", "train", *HUGE, "--set",
                           f"memory.shm_dir={shm_dir}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # no Ray start-up lines: refused before Ray
    assert re.match(r"error: the run needs [0-9.]+ TiB in memory.shm_dir \(the weights and AdamW state\) but only "
                    r"[0-9.]+ \wiB is free there; use a smaller model", lines[0]), lines[0]
    assert "micro_batch_size" not in lines[0]  # that memory is weights and optimizer state, not activations
    assert "total /dev/shm" in proc.stdout and "DOES NOT FIT" in proc.stdout
    assert os.listdir(tmp_path) == [] and os.listdir(shm_dir) == []


def test_host_available_is_below_physical_memory():
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < machine.host_available() <= total


def test_check_waits_while_a_finished_run_releases_its_memory(tmp_path, monkeypatch):
    """Right after another run ends its memory comes back as its processes exit: a run that would
    fit an idle machine waits while the free memory grows, then starts."""
    import dataclasses

    cfg = load_config(None, [f"train.run_dir={tmp_path}"])
    real = planned(cfg, "cpu", starts_ray=False)
    need = real.total("shm")
    frees = iter([need // 2, need // 2 + need // 4, need * 2])  # releasing, still short, then enough
    monkeypatch.setattr(resolve_module, "RELEASE_POLL_S", 0.01)
    monkeypatch.setattr(preflight, "count", lambda *a, **k: dataclasses.replace(real, shm_free=next(frees)))
    lines = []
    run = resolve(cfg, Facts("cpu"))
    short = dataclasses.replace(run, memory=dataclasses.replace(real, shm_free=next(frees)))
    assert check(short, lines.append).shm_free == need * 2
    assert lines == ["waiting for the memory of a run that just ended to be released"]

    frees = iter([need // 2])  # not growing: fails at once, with the table and the sentence
    try:
        check(dataclasses.replace(run, memory=dataclasses.replace(real, shm_free=need // 2)), lines.append)
    except preflight.PreflightError as e:
        assert str(e).startswith("the run needs")
    else:
        raise AssertionError("a run that does not fit was not refused")


def test_check_counts_again_with_the_decisions_the_run_resolved(tmp_path, monkeypatch):
    """While check waits for memory it counts the plan again with the run's own decisions, not chosen
    anew: a LoRA run whose embedding is trained in full holds it on the device (the schedule's resident
    units), where the plan counts it with the adapters, not as a memory.resident unit. Counted again
    with the schedule's units instead, the plan would gain a memory.resident row and lose that unit
    from the weight slots."""
    import dataclasses

    cfg = load_config(None, ["compute.device=cpu", "lora.rank=4", "lora.train_embedding=true", f"train.run_dir={tmp_path}"])
    run = resolve(cfg, Facts("cpu", host_bytes=64 * 2**30))
    assert run.memory.resident == run.decisions.resident == () != run.schedule.resident
    monkeypatch.setattr(resolve_module, "RELEASE_POLL_S", 0.01)
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**40, 0, 2**39))
    lines = []
    short = dataclasses.replace(run, memory=dataclasses.replace(run.memory, shm_free=0))  # then memory comes back
    again = check(short, lines.append)
    assert lines == ["waiting for the memory of a run that just ended to be released"]  # it did count again
    assert again.shm_free == 2**39 and again.rows == run.memory.rows
    assert again.resident == run.memory.resident and again.placement == run.compute.activations
    assert not any("(memory.resident)" in r.component for r in again.rows)


def test_host_available_is_capped_by_this_process_cgroup(tmp_path):
    """The limit of the cgroup the process is in (found through /proc/self/cgroup) caps it, as do
    the limits of the cgroups above; unlimited ("max") ones do not."""
    own = machine._cgroup_memory_files(str(tmp_path))[0]
    os.makedirs(os.path.dirname(own[0]), exist_ok=True)
    with open(own[0], "w") as f:
        f.write(str(2**30))
    with open(own[1], "w") as f:
        f.write(str(2**28))
    assert machine.host_available(str(tmp_path)) == 2**30 - 2**28
    with open(own[0], "w") as f:
        f.write("max")
    assert machine.host_available(str(tmp_path)) > 2**30 - 2**28


def test_host_rows_for_cuda_compile_workers_offload_and_ray_margin(monkeypatch):
    """A CUDA run's host side: the compute worker's CUDA context, compile workers only when asked
    for, offloaded checkpoints at what the pinned allocator takes (powers of 2), and the share of
    RAM Ray's memory monitor needs free (none when the monitor is off)."""
    base = ["model.hidden_size=1008", "model.num_hidden_layers=6", "model.intermediate_size=2816",
            "model.num_attention_heads=8", "model.vocab_size=32000", "train.seq_len=500",
            "train.micro_batch_size=3", "train.num_micro_batches=2", "memory.activations=offload"]
    rows = {r.component: r for r in planned(load_config(None, base), "cuda", device_bytes=80 * 2**30,
                                            starts_ray=False).rows}
    assert rows["CUDA context, host side (1 compute worker(s))"].where == "host"
    assert not any("compile worker" in name for name in rows)
    offload = next(r for name, r in rows.items() if name.startswith("activation checkpoints (6 x 2"))
    per_buffer = 3 * 500 * 1008 * 2  # bf16 [3, 500, 1008] = 3,024,000 bytes -> 4 MiB pinned
    assert offload.where == "host" and offload.nbytes == 6 * 2 * 4 * 2**20 != 6 * 2 * per_buffer
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    margin = next(r for name, r in rows.items() if name.startswith("Ray memory monitor"))
    assert margin.nbytes == int(0.05 * total)

    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")
    plan = planned(load_config(None, base + ["compute.compile_threads=8"]), "cuda",
                   device_bytes=80 * 2**30, starts_ray=False)
    names = [r.component for r in plan.rows]
    assert not any(n.startswith("Ray memory monitor") for n in names)
    workers = next(r for r in plan.rows if "compile worker" in r.component)
    assert workers.nbytes == 8 * preflight.COMPILE_WORKER_BYTES
    cpu_rows = [r.component for r in planned(load_config(None, base + ["compute.compile_threads=8"]), "cpu",
                                             starts_ray=False).rows]
    assert not any("compile worker" in n or "CUDA context" in n for n in cpu_rows)  # no compile on the CPU


def test_device_rows_use_the_buffer_depth_and_loss_chunk_resolved_for_the_device():
    cfg = load_config(None, ["model.hidden_size=256", "model.num_hidden_layers=2", "model.intermediate_size=704",
                             "model.num_attention_heads=4", "model.vocab_size=4096", "train.seq_len=512",
                             "train.micro_batch_size=32",  # 16,384 tokens per micro-batch: more than a chunk
                             "memory.resident=none"])  # every unit streamed through the slots
    layout = StoreLayout.build(cfg.model)
    for device, depth, chunk, itemsize in (("cuda", 3, 8192, 2), ("cpu", 2, 1024, 4)):
        rows = {r.component: r.nbytes for r in planned(cfg, device, device_bytes=80 * 2**30,
                                                       starts_ray=False).rows}
        assert rows[f"weight slots ({depth} x largest unit)"] == depth * layout.max_unit_numel * itemsize
        assert f"loss chunk ({chunk} tokens x 4096 logits)" in rows
    explicit = load_config(None, ["memory.buffer_depth=5", "memory.loss_chunk_size=300"])
    names = [r.component for r in preflight.device_rows(explicit, "cuda", 8)]
    assert "weight slots (5 x largest unit)" in names and "loss chunk (300 tokens x 260 logits)" in names


def test_the_object_store_is_counted_only_when_the_run_starts_ray():
    """cluster.ray_address=local starts a private Ray (its object store is the run's); an address
    names a cluster that keeps its own."""
    for address, counted in (("local", True), ("127.0.0.1:1", False)):
        cfg = load_config(None, [f"cluster.ray_address={address}"])
        names = [r.component for r in planned(cfg, "cpu", starts_ray=cluster_to_join(cfg.cluster)[0] is None).rows]
        assert ("Ray object store" in names) == counted


def test_plan_for_several_gpus_counts_each_gpus_share_and_each_worker():
    """With N compute workers per node each GPU holds the checkpoints of 1/N of the micro-batches,
    while the node's host side holds N prefetch + compute processes and N CUDA contexts."""
    base = ["model.hidden_size=512", "model.num_hidden_layers=4", "model.num_attention_heads=8",
            "train.seq_len=256", "train.micro_batch_size=2", "train.num_micro_batches=4", "memory.activations=recompute"]
    one, two = (planned(load_config(None, base + [f"parallel.compute_workers={n}"]), "cuda",
                        device_bytes=80 * 2**30, starts_ray=False) for n in (1, 2))
    rows1, rows2 = ({r.component: r for r in p.rows} for p in (one, two))
    assert rows1["activation checkpoints (5 x 4 x 512 tokens x 512)"].nbytes == \
        2 * rows2["activation checkpoints (5 x 2 x 512 tokens x 512)"].nbytes
    assert rows2["CUDA context, host side (2 compute worker(s))"].nbytes == \
        2 * rows1["CUDA context, host side (1 compute worker(s))"].nbytes
    procs = [r for name, r in rows2.items() if name.endswith("processes (driver, store, 2 x prefetch + compute, sink, "
                                                             "loaders)")]
    assert len(procs) == 1 and procs[0].nbytes == 8 * preflight.PROCESS_BYTES
    assert "1/2 of the micro-batches" in two.title

