"""Units updated on the compute worker's device (memory.resident, megatrain_ray.engine.compute.resident).

On the CPU backend the resident units go through the sink's own AdamW kernel on the gradient the sink
would have read, clipped by the same factor (the same squared norms summed in the same order), so a
run with ``embed_head`` must equal the host-updated run bit for bit: losses, grad norms, every weight
and moment of every checkpoint, the exported weights. Any difference is a bug of the protocol
(a stale copy, a missed sync, a wrong clipping factor or step), not rounding.
"""

import json
import os
import re
import threading
from pathlib import Path

import pytest
import torch

from megatrain_ray import cli
from megatrain_ray.config import load_config
from megatrain_ray.engine.compute.device import CpuBackend
from megatrain_ray.engine.compute.resident import ResidentUnits, checkpoint_due, sync_due
from megatrain_ray.engine.store.host_store import ParameterStore, StoreSpec, resident_units
from megatrain_ray.errors import ConfigError, PipelineError
from megatrain_ray.io import checkpoint, writer
from megatrain_ray.model.layout import StoreLayout
from megatrain_ray.model.precision import Precision
from megatrain_ray.model.presets import preset_shape
from megatrain_ray.orchestration.device_memory import _fixed_device_rows, resolve_resident
from megatrain_ray.orchestration.local import train_local
from megatrain_ray.orchestration.pipeline import Interrupted, train

from artifacts import differing, read_tensors
from conftest import interrupt_after_checkpoint, kill_in_turn

STEPS = 12
CLIPPED = ("optim.max_grad_norm=0.5", "optim.weight_decay=0.1", "optim.warmup_steps=2")
"""Clipping active every step (the tiny model's norms are 2-3) and decay on: the factor and the spans matter."""


def _cfg(shm_dir, run_dir, *extra):
    return load_config(None, [f"memory.shm_dir={shm_dir}", f"train.run_dir={run_dir}", "compute.device=cpu",
                              f"train.steps={STEPS}", "train.seq_len=32", "train.micro_batch_size=2",
                              "cluster.actor_timeout_s=120", *CLIPPED, *extra])




@pytest.mark.parametrize("layers", [0, 1])
@pytest.mark.parametrize("tied", [False, True])
def test_resident_units_on_the_device_give_the_host_update_bit_for_bit(tied, layers, shm_dir, tmp_path):
    rows = {}
    mode = "embed_head"
    for setting in ("none", mode):
        resident = [f"memory.resident={setting}", *([f"memory.resident_layers={layers}"] if setting == mode else [])]
        cfg = _cfg(shm_dir, tmp_path, *resident, f"model.tie_word_embeddings={str(tied).lower()}")
        rows[setting] = train_local(cfg, 0)
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in rows["none"]] == [r[key] for r in rows[mode]], key
    assert all(r["grad_norm"] > 0.5 for r in rows["none"])  # clipped every step
    # Only the other decoder layers are streamed (each twice); the resident units never leave the device.
    assert rows["none"][0]["fetches"]["embed"] == (2 if tied else 1)
    streamed = cfg.model.num_hidden_layers - layers
    assert rows[mode][0]["fetches"] == {"layers": 2 * streamed}
    assert os.listdir(shm_dir) == []


@pytest.fixture(scope="module")
def host_run(ray_cluster, tmp_path_factory, shm_dirs):
    """A: the host update, a checkpoint after every step."""
    base = tmp_path_factory.mktemp("host")
    with shm_dirs() as shm_dir:
        return train(_cfg(shm_dir, base, "train.checkpoint_every=1", f"train.keep_checkpoints={STEPS}"),
                     log=lambda line: None)


def test_checkpoints_interrupt_resume_and_export_with_resident_embed_head_match_the_host_run(host_run, shm_dir, tmp_path):
    a_ckpts = os.path.join(host_run.run_dir, "checkpoints")
    # B: embed_head on the device, a checkpoint every step (the sink waits for the worker's copy before
    # each; the worker's next copy waits until the checkpoint has written the last), interrupted once
    # step 2's is out (the worker copies its units in for the store's save).
    lines = []
    with pytest.raises(Interrupted) as info:
        train(_cfg(shm_dir, tmp_path / "b", "memory.resident=embed_head", "train.checkpoint_every=1",
                   f"train.keep_checkpoints={STEPS}"), log=interrupt_after_checkpoint(2, lines))
    boundary = checkpoint.read_meta(info.value.checkpoint)["step"]
    assert 2 <= boundary < STEPS, lines
    b_run = os.path.dirname(os.path.dirname(info.value.checkpoint))
    b_ckpts = sorted(os.listdir(os.path.join(b_run, "checkpoints")))
    assert b_ckpts == [f"step-{s:06d}" for s in range(1, boundary + 1)], b_ckpts
    for name in b_ckpts:  # weights and AdamW states, the resident units' included
        ours = read_tensors(os.path.join(b_run, "checkpoints", name))
        theirs = read_tensors(os.path.join(a_ckpts, name))
        assert any("embed_tokens" in k for k in ours) and any("exp_avg" in k for k in ours)
        assert not differing(ours, theirs), (name, differing(ours, theirs)[:4])

    # C: resume B (its newest checkpoint, the boundary) in place, with embed_head on the device (from the host
    # copy the worker synced), to the end.
    assert cli.main(["train", "--resume", b_run]) == 0
    c_run = Path(b_run)
    assert not differing(read_tensors(host_run.final_dir), read_tensors(c_run / "final"))  # the export at the end
    assert not differing(read_tensors(os.path.join(a_ckpts, f"step-{STEPS:06d}")),
                      read_tensors(c_run / "checkpoints" / f"step-{STEPS:06d}"))
    rows_a = [json.loads(line) for line in open(os.path.join(host_run.run_dir, "metrics.jsonl"))]
    rows_c = [json.loads(line) for line in open(c_run / "metrics.jsonl")]
    assert [(r["loss"], r["grad_norm"]) for r in rows_c] == [(r["loss"], r["grad_norm"]) for r in rows_a]
    assert os.listdir(shm_dir) == []


@pytest.mark.slow  # kills actors and restarts the pipeline
def test_a_killed_compute_worker_takes_its_units_along_and_the_restart_still_ends_bit_for_bit(host_run, shm_dir,
                                                                                             tmp_path):
    """The compute worker dies with the only current copy of the embedding and head: the restart
    resumes from the last checkpoint, where the worker's synced copy is; then the sink dies."""
    lines = []
    result = train(_cfg(shm_dir, tmp_path, "memory.resident=embed_head", "train.checkpoint_every=2",
                        f"train.keep_checkpoints={STEPS}", "cluster.max_restarts=2"),
                   log=kill_in_turn(["compute", "grad-sink"], lines))
    assert sum(line.startswith("restart ") for line in lines) == 2, "\n".join(lines)
    assert not differing(read_tensors(host_run.final_dir), read_tensors(result.final_dir))
    assert not differing(read_tensors(os.path.join(host_run.run_dir, "checkpoints", f"step-{STEPS:06d}")),
                      read_tensors(os.path.join(result.run_dir, "checkpoints", f"step-{STEPS:06d}")))
    assert os.listdir(shm_dir) == []


def test_the_copy_waits_while_a_checkpoint_reads_the_previous_one(shm_dir):
    cfg = load_config(None, [f"memory.shm_dir={shm_dir}", "compute.device=cpu", "memory.resident=embed_head"])
    spec = StoreSpec(cfg.model, Precision(torch.float32, torch.float32), shm_dir, os.getpid(), "held",
                     resident=resident_units(cfg.model, 0))
    ps = ParameterStore(spec, seed=0)
    try:
        resident = ResidentUnits(ps.store, CpuBackend(1, 1, torch.float32), cfg.optim, 10, timeout_s=0.3)
        before = resident.weights(0, 0).clone()
        head = cfg.model.num_hidden_layers + 1
        for u in (0, head):
            resident.take_grad(u, torch.ones(ps.store.layout.templates[u].numel))
        assert resident.update(0, 4.0) and resident.version == 1
        assert not torch.equal(resident.weights(0, 1), before)
        assert torch.equal(ps.store.block("master", 0), before)  # the host copy is untouched until a sync
        ps.store.set_checkpoint_copy(0)  # the checkpoint of step 0 still reads it
        with pytest.raises(PipelineError, match=r"waited 0 s for the checkpoint of step 0 to write embed, head"):
            resident.sync()
        assert ps.store.state_version(0) == 0
        ps.store.set_checkpoint_copy(None)
        resident.sync()
        assert torch.equal(ps.store.block("master", 0), resident.weights(0, 1))
        assert (ps.store.state_version(0), ps.store.version(head)) == (1, 1)
        with pytest.raises(PipelineError, match="on the device has 1 updates but step 3 needs 3"):
            resident.weights(0, 3)
        assert not resident.update(1, float("inf")) and resident.version == 1  # the sink stops the run on it, and so
        assert resident.weights(0, 1) is None  # does the next step (the compute worker waits, then says these words):
        assert re.match(r"the gradient norm of step 2 is inf; training diverged", resident.diverged)
        resident.close()
    finally:
        ps.close()


def test_the_copy_is_due_at_checkpoint_boundaries_and_the_end_and_held_for_checkpoints():
    checkpoints = checkpoint.CheckpointSettings("unused", 3, 2, {}, "r", {})
    assert [s for s in range(10) if sync_due(checkpoints, s, 0, 10)] == [2, 5, 8, 9]
    assert [s for s in range(10) if checkpoint_due(checkpoints, s, 0, 10)] == [2, 5, 8, 9]  # the end is saved too
    assert [s for s in range(4, 10) if sync_due(None, s, 4, 10)] == [9]
    assert not any(checkpoint_due(None, s, 4, 10) for s in range(4, 10))  # the export's copy: nothing to hold for
    never = checkpoint.CheckpointSettings("unused", 0, 2, {}, "r", {})  # checkpoints only on an interrupt
    assert [s for s in range(10) if sync_due(never, s, 0, 10)] == [9] and not checkpoint_due(never, 9, 0, 10)


def test_a_copy_for_a_checkpoint_stays_until_its_writer_has_written_it(shm_dir, tmp_path):
    """With a checkpoint every step the worker reaches its next copy before the sink has started the
    checkpoint of the previous one (the sink may still be writing the one before): that copy waits."""
    cfg = load_config(None, [f"memory.shm_dir={shm_dir}", "compute.device=cpu", "memory.resident=embed_head"])
    spec = StoreSpec(cfg.model, Precision(torch.float32, torch.float32), shm_dir, os.getpid(), "ahead",
                     resident=resident_units(cfg.model, 0))
    ps = ParameterStore(spec, seed=0)
    store = ps.store
    try:
        resident = ResidentUnits(store, CpuBackend(1, 1, torch.float32), cfg.optim, 10, timeout_s=60)

        def update(step: int) -> None:  # the step's update of the resident units, on the "device"
            resident.weights(0, step)
            for u in resident.units:
                resident.take_grad(u, torch.full((store.layout.templates[u].numel,), 0.1 * (step + 1)))
            assert resident.update(step, 1.0)

        update(0)
        for u in range(len(store.layout.units)):  # the sink's units reach boundary 1 too
            if u not in resident.units:
                store.set_version(u, 1)
        resident.sync(for_checkpoint=True)  # the copy of boundary 1, a checkpoint's
        assert store.checkpoint_copy() == 1 and store.state_version(0) == 1
        at_1 = store.block("master", 0).clone()
        update(1)
        ahead = threading.Thread(target=resident.sync, args=(True,))  # the copy of boundary 2
        asked, held = threading.Event(), store.checkpoint_copy

        def checkpoint_copy():  # the held copy, and an event once the copy ahead has found it held
            copy = held()
            if threading.current_thread() is ahead and copy is not None:
                asked.set()
            return copy

        store.checkpoint_copy = checkpoint_copy
        ahead.start()
        assert asked.wait(timeout=60)  # it found boundary 1's copy held, so it waits (no wait on its timing)
        assert ahead.is_alive() and store.state_version(0) == 1 and torch.equal(store.block("master", 0), at_1)
        checkpoints = checkpoint.CheckpointSettings(str(tmp_path), 1, 5, cfg.to_dict(), "r", {})
        write = writer.CheckpointWriter(store, checkpoints)
        head = cfg.model.num_hidden_layers + 1
        write.start(1, [0, head, *range(1, head)], held=(0, head))  # as the sink orders them: the resident units first
        ahead.join(timeout=60)
        notice = write.finish()
        assert not ahead.is_alive() and store.checkpoint_copy() == 2 and store.state_version(0) == 2
        saved = read_tensors(notice["checkpoint"])["model.embed_tokens.weight"].flatten()
        assert torch.equal(saved, at_1) and not torch.equal(saved, store.block("master", 0))
    finally:
        ps.close()


@pytest.mark.parametrize("extra,says", [
    (("memory.resident=all",), "memory.resident must be auto, none or embed_head, got 'all'"),
    (("memory.resident=embed_head", "memory.resident_layers=x"), "memory.resident_layers must be an integer, got 'x'"),
    (("memory.resident_layers=1",), "memory.resident_layers (1) is read only with memory.resident embed_head (got "
     "'auto')"),
    (("memory.resident=embed_head", "memory.resident_layers=9",), "memory.resident_layers (9) names more decoder "
     "layers than the model has"),
    (("memory.resident=embed_head", "parallel.compute_workers=2"), "memory.resident (embed_head, 0 layers) needs "
     "one compute worker in the whole run (got 2 x 1)"),
    (("memory.resident=embed_head", "precision.master_dtype=bfloat16"), "memory.resident (embed_head, 0 layers) "
     "needs fp32 master weights and moments (precision.master_dtype bfloat16, optim.state fp32)"),
    (("memory.resident=embed_head", "optim.state=8bit"), "needs fp32 master weights and moments"),
])
def test_settings_it_cannot_serve_are_refused_by_name(extra, says, shm_dir):
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(None, [f"memory.shm_dir={shm_dir}", *extra])


def test_auto_makes_the_embedding_head_and_layer_0_resident_on_one_gpu_where_they_fit_and_nothing_elsewhere():
    """memory.resident=auto (the default) as a run resolves it: embed_head with one layer where the
    plan fits it with every checkpoint on the GPU, else embed_head, else none; none wherever a
    resident unit is refused or pointless."""
    shape = [f"model.{k}={v}" for k, v in preset_shape("7b").items()]  # its small default step: 2 x 8 x 64 tokens

    def auto(gib, *extra, device="cuda"):
        cfg = load_config(None, ["compute.device=cuda", *shape, *extra])
        return resolve_resident(cfg, device, gib * 2**30)

    # embed_head and layer 0 hold 17.3 GiB on the GPU at this shape, embed_head alone 14.2: the plan's totals decide
    assert [auto(g) for g in (140, 27, 24, 20)] == [1, 1, 0, None]
    assert auto(140, device="cpu") is None  # the CPU's "device" is the host: nothing to gain
    for extra in (["parallel.compute_workers=2", "train.num_micro_batches=2"], ["precision.master_dtype=bfloat16"],
                  ["optim.state=8bit"], ["memory.activations=counts", "memory.kept_layers=3", "memory.offloaded_layers=5"]):
        assert auto(140, *extra) is None, extra  # several copies; no fp32 state; checkpoints already offloaded
    assert auto(20, "memory.resident=embed_head") == 0  # a setting given is kept (the plan then judges it)


def test_auto_makes_more_layers_resident_where_the_host_update_paces_the_step():
    """Where the host's AdamW outlasts the GPU's step (the Qwen3-30B-A3B shape at 8 layers, 65,536
    tokens, 4.4 G parameters on an H200 box's 12 AdamW threads: few FLOPs per parameter), memory.resident
    auto takes the count of resident layers, of those that fit, whose expected step with the updates is
    the shortest: the host updates fewer parameters, the resident layers' state and gradients take the
    room of kept activations. Where the step hides the host update (the 7B's), it stays at the first
    fit; its gradients are counted until the step's end."""
    from megatrain_ray.orchestration.device_memory import GPU_USABLE, device_total
    from megatrain_ray.orchestration.resolve import Facts, resolve

    def run(preset, layers, *extra):
        shape = [f"model.{k}={v}" for k, v in preset_shape(preset, layers).items()]
        cfg = load_config(None, ["compute.device=cuda", *shape, "model.max_position_embeddings=4096",
                                 "train.seq_len=4096", "train.micro_batch_size=4", "train.num_micro_batches=4", *extra])
        return resolve(cfg, Facts("cuda", device_bytes=139 * 2**30, host_bytes=2**40, device_tflops=989.0,
                                  adamw_cpus=12))

    first = run("qwen3-30b-a3b", 8, "memory.resident=embed_head", "memory.resident_layers=1")
    auto = run("qwen3-30b-a3b", 8)
    assert first.updates.host_path_s(first.pace) > first.pace.step_s  # the host paces the first fit
    # every layer: the GPU has room for all their state (measured on an H200: 1.047 s a step with 8
    # resident, 1.122 with 6, 1.190 with 5; benchmarks/results/2026-12-04_h200_update-placement-resident-layers)
    assert auto.resident_layers == 8 and auto.schedule.resident == tuple(range(10))
    assert auto.updates.step_s(auto.pace) < first.updates.step_s(first.pace)
    assert auto.updates.host_params == sum(t.numel for i, t in enumerate(auto.layout.templates)
                                           if i not in auto.schedule.resident)
    assert device_total(auto.memory.rows) <= auto.facts.device_bytes * GPU_USABLE
    assert not any(r.where == "host" for r in auto.memory.rows if r.component.startswith("activation"))
    # the gradients of layers 1.. wait for the step's end (layer 0's, the backward's last, is its working set's)
    grads = [r.nbytes for r in auto.memory.rows if r.component.startswith("fp32 gradients of ")]
    assert grads == [4 * sum(auto.layout.templates[u].numel for u in range(2, auto.resident_layers + 1))]
    # one layer fewer lengthens it
    for k in (auto.resident_layers - 1,):
        other = run("qwen3-30b-a3b", 8, "memory.resident=embed_head", f"memory.resident_layers={k}")
        assert other.updates.step_s(other.pace) >= auto.updates.step_s(auto.pace), k
    assert run("7b", 28).resident_layers == 1  # the step hides the host's update


def test_the_plan_counts_the_resident_state_and_streams_smaller_slots():
    shape = [f"model.{k}={v}" for k, v in preset_shape("7b").items()]  # its embedding outweighs a layer
    base = load_config(None, ["compute.device=cuda", *shape])
    embed_head = load_config(None, ["compute.device=cuda", "memory.resident=embed_head", *shape])
    rows = {mode: {r.component: r.nbytes for r in _fixed_device_rows(c, "cuda", 1)} for mode, c in
            (("none", base), ("embed_head", embed_head))}
    m = base.model
    resident = [k for k in rows["embed_head"] if k.startswith("embed, head: ")]
    assert len(resident) == 1
    head = m.hidden_size + (0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size)
    assert rows["embed_head"][resident[0]] == (m.vocab_size * m.hidden_size + head) * (12 + 2)
    slots = lambda r: next(v for k, v in r.items() if k.startswith("weight slots"))  # noqa: E731
    layout = StoreLayout.build(base.model)  # the head is the largest unit, then a decoder layer
    assert slots(rows["embed_head"]) == 3 * layout.templates[1].numel * 2 < slots(rows["none"]) == 3 * head * 2
