"""Streamed units updated on the compute worker's device (optim.placement device,
megatrain_ray.engine.compute.device_updates).

On the CPU backend each such unit's state is copied in from the host store, updated by the sink's own
AdamW kernel on the fp32 gradient the sink would have read (the CPU's gradient dtype is fp32), clipped
by the same factor (the same squared norms summed in the same order), and written back: so a run with
optim.placement device must equal the host-updated run bit for bit (losses, grad norms, every weight
and moment of every checkpoint, the export). Any difference is a bug of the protocol (a stale copy, a
missed write-back, a wrong clipping factor, step or decay range), not rounding.
"""

import dataclasses
import json
import math
import os
import re
import threading
from pathlib import Path

import pytest
import torch

from megatrain_ray import cli
from megatrain_ray.config import load_config
from megatrain_ray.engine.compute.device import CpuBackend
from megatrain_ray.engine.compute import device_updates
from megatrain_ray.engine.compute.activations import KEEP
from megatrain_ray.engine.compute.device_updates import StreamedUpdates
from megatrain_ray.engine.compute.resident import STATE_KINDS
from megatrain_ray.engine.optim import AdamWRunner
from megatrain_ray.engine.policy import STREAMED_ON_DEVICE, UnitPolicy
from megatrain_ray.engine.sink.updates import CompactAdamW, ExactAdamW
from megatrain_ray.engine.store.host_store import SCALE_KINDS, ParameterStore, StoreSpec
from megatrain_ray.errors import ConfigError
from megatrain_ray.io import checkpoint
from megatrain_ray.model.precision import Precision, resolve_precision
from megatrain_ray.model.presets import preset_shape
from megatrain_ray.orchestration import pace
from megatrain_ray.orchestration.device_memory import GPU_USABLE, _fixed_device_rows, device_total
from megatrain_ray.orchestration.local import train_local
from megatrain_ray.orchestration.pipeline import Interrupted, train
from megatrain_ray.orchestration.resolve import Facts, resolve

from artifacts import differing, read_tensors
from conftest import interrupt_after_checkpoint, kill_in_turn

STEPS = 8
CLIPPED = ("optim.max_grad_norm=0.5", "optim.weight_decay=0.1", "optim.warmup_steps=2")
"""Clipping active every step (the tiny model's norms are 2-3), decay on, a warmup: the factor, the spans
and the schedule matter."""
DEVICE = "optim.placement=device"


def _cfg(shm_dir, run_dir, *extra):
    return load_config(None, [f"memory.shm_dir={shm_dir}", f"train.run_dir={run_dir}", "compute.device=cpu",
                              f"train.steps={STEPS}", "train.seq_len=32", "train.micro_batch_size=2",
                              "cluster.actor_timeout_s=120", *CLIPPED, *extra])


@pytest.mark.parametrize("extra", [
    (),
    ("optim.max_grad_norm=0",),  # no clipping: the host updates each unit as its gradient arrives
    ("optim.decay_norms_and_biases=true", "model.tie_word_embeddings=true"),
    ("memory.resident=embed_head",),  # beside resident units, which the worker updates first
    ("optim.state=8bit",),  # the compact state: torch's form of the sink's kernel, the same bits
])
def test_streamed_units_updated_on_the_device_give_the_host_update_bit_for_bit(extra, shm_dir, tmp_path):
    rows = {placement: train_local(_cfg(shm_dir, tmp_path, f"optim.placement={placement}", *extra), 0)
            for placement in ("host", "device")}
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in rows["host"]] == [r[key] for r in rows["device"]], key
    if "optim.max_grad_norm=0" not in extra:
        assert all(r["grad_norm"] > 0.5 for r in rows["host"])  # clipped every step
    assert len({r["lr"] for r in rows["host"]}) > STEPS // 2  # warmup, then the cosine: the lr moves
    # Every unit is still streamed; the host's CPUs update none of them, the device all of them.
    assert [r["fetches"] for r in rows["host"]] == [r["fetches"] for r in rows["device"]]
    # (a step's device updates run beside the next step: their span is in whichever step's timeline they end)
    assert all(r["update_busy_s"] == 0 for r in rows["device"]) and sum(r["device_update_busy_s"] for r in rows["device"]) > 0
    assert all(r["update_busy_s"] > 0 for r in rows["host"])
    assert os.listdir(shm_dir) == []


def test_a_mixture_of_experts_updated_on_the_device_gives_the_host_update_bit_for_bit(shm_dir, tmp_path):
    """Sparse layers: an expert no token chose has a zero gradient on the device, which its update
    applies as the host's applies the zeroed ranges; no expert's gradient crosses the link."""
    root = Path(__file__).resolve().parents[1]
    rows = {placement: train_local(load_config(str(root / "configs" / "tiny-moe.yaml"), [
        f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path}", "compute.device=cpu", "train.steps=6",
        "optim.max_grad_norm=0.5", "optim.weight_decay=0.1", f"optim.placement={placement}"]), 0)
        for placement in ("host", "device")}
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in rows["host"]] == [r[key] for r in rows["device"]], key
    assert any(b for r in rows["host"] for layer in r["expert_grad_bytes"] for b in layer)
    assert not any(b for r in rows["device"] for layer in r["expert_grad_bytes"] for b in layer)
    assert os.listdir(shm_dir) == []


def test_gradients_held_for_the_norm_beside_units_updated_on_the_device_train_as_with_a_host_gradient_array(
        shm_dir, tmp_path, monkeypatch):
    """The 8-bit state with the last two layers' updates on the device (as optim.placement auto places
    them on a GPU) and the others' gradients held on the device until the step's norm is known
    (experimental.hold_grads): every unit is clipped by the whole step's norm, the device units' with
    the held ones' and the held ones' with the device units' (their tickets, sent during the backward,
    carry no norm), summed in the same order as with a host gradient array: losses, norms and
    learning rates bit for bit."""
    from megatrain_ray.orchestration import resolve as resolve_module

    def last_two_layers(cfg, device, layout, *rest):
        return tuple(u.index for u in layout.layers)[-2:]

    monkeypatch.setattr(resolve_module, "units_on_device", last_two_layers)
    base = ("precision.compute_dtype=bfloat16", "optim.state=8bit", "model.num_hidden_layers=4")
    runs = {hold: resolve(_cfg(shm_dir, tmp_path, *base, f"experimental.hold_grads={hold}"), Facts("cpu"))
            for hold in ("false", "true")}
    assert runs["true"].store.hold_grads and not runs["false"].store.hold_grads
    for run in runs.values():
        assert [p == STREAMED_ON_DEVICE for p in run.policies] == [False] * 3 + [True] * 2 + [False]
    rows = {hold: train_local(run.config, 0) for hold, run in runs.items()}
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in rows["true"]] == [r[key] for r in rows["false"]], key
    assert all(r["grad_norm"] > 0.5 for r in rows["true"])  # clipped every step
    assert all(r["update_busy_s"] > 0 for r in rows["true"]) and sum(r["device_update_busy_s"] for r in rows["true"]) > 0
    assert os.listdir(shm_dir) == []


def _store(shm_dir: str, run_id: str, cfg) -> ParameterStore:
    spec = StoreSpec(cfg.model, Precision(torch.float32, torch.float32), shm_dir, os.getpid(), run_id)
    return ParameterStore(spec, seed=0)


@pytest.mark.parametrize("piece", [device_updates.PIECE, 1000])
@pytest.mark.parametrize("decay_norms", [False, True])
def test_one_device_update_equals_the_host_update_on_the_same_gradient(decay_norms, piece, shm_dir, monkeypatch):
    """Unit by unit, step by step: the state the device update writes back is the host's, bit for bit,
    for the step's clipping factor, learning rate and both decay ranges, whether a unit is updated in
    one piece or in many (1000 elements: pieces across the boundary of the decay spans); the versions
    say the step."""
    monkeypatch.setattr(device_updates, "PIECE", piece)
    cfg = load_config(None, [f"memory.shm_dir={shm_dir}", "compute.device=cpu", "optim.weight_decay=0.1",
                             f"optim.decay_norms_and_biases={str(decay_norms).lower()}", "optim.warmup_steps=1"])
    host, dev = _store(shm_dir, "host", cfg), _store(shm_dir, "dev", cfg)
    runner = AdamWRunner(2)
    try:
        units = tuple(range(len(host.store.layout.units)))
        exact = ExactAdamW(host.store, runner, cfg.optim, 10)
        updates = StreamedUpdates(dev.store, CpuBackend(1, 1, torch.float32), units, cfg.optim, 10, timeout_s=60)
        gen = torch.Generator().manual_seed(0)
        for step in range(3):
            grads = {u: torch.randn(host.store.layout.templates[u].numel, generator=gen) for u in units}
            sq = [torch.dot(g, g) for g in grads.values()]
            norm = math.sqrt(sum(float(s) for s in sq))
            coef = min(1.0, cfg.optim.max_grad_norm / (norm + 1e-6))
            assert coef < 1.0  # clipped: the factor matters
            for u in units:
                exact.update(u, grads[u].clone(), coef, step)
                updates.take_grad(u, grads[u].clone())
            updates.end_step(step, sq, sync=False, for_checkpoint=False)
            updates.join()  # the updater thread's work done
            for u in units:
                for kind in STATE_KINDS:
                    assert torch.equal(host.store.block(kind, u), dev.store.block(kind, u)), (step, u, kind)
                assert (dev.store.version(u), dev.store.state_version(u)) == (step + 1, step + 1)
        # A step whose norm is not finite applies nothing (the sink stops the run on it).
        before = {u: dev.store.block("master", u).clone() for u in units}
        for u in units:
            updates.take_grad(u, torch.full((host.store.layout.templates[u].numel,), float("nan")))
        updates.end_step(3, [torch.tensor(float("nan"))], sync=False, for_checkpoint=False)
        updates.join()  # the updater thread's work done
        assert all(torch.equal(before[u], dev.store.block("master", u)) and dev.store.version(u) == 3 for u in units)
        updates.close()
    finally:
        runner.close()
        host.close()
        dev.close()


@pytest.mark.parametrize("piece,chunk", [(device_updates.PIECE, device_updates.COMPACT_CHUNK), (4096, 2048)])
def test_the_compact_state_updated_on_the_device_equals_the_sink_update_bit_for_bit(piece, chunk, shm_dir,
                                                                                     monkeypatch):
    """The 8-bit state (bf16 master weights, uint8 codes, fp32 block scales) updated by StreamedUpdates
    (:func:`~megatrain_ray.engine.compact.step_reference`, the code a GPU runs) and by the sink's compact
    kernel, unit by unit over 3 clipped steps: every array equal, the stream copy too, whether a unit is
    one piece or many (4,096 elements: pieces across the decay spans, 2,048-element chunks within them)."""
    monkeypatch.setattr(device_updates, "PIECE", piece)
    monkeypatch.setattr(device_updates, "COMPACT_CHUNK", chunk)
    cfg = load_config(None, [f"memory.shm_dir={shm_dir}", "compute.device=cpu", "optim.weight_decay=0.1",
                             "optim.state=8bit", "optim.warmup_steps=1"])
    precision = resolve_precision(cfg.precision, "cpu", "8bit")
    stores = [ParameterStore(StoreSpec(cfg.model, precision, shm_dir, os.getpid(), run), seed=0) for run in ("h", "d")]
    host, dev = (p.store for p in stores)
    assert host.separate_stream_copy  # the CPU computes in fp32: the stream copy is written beside the state
    runner = AdamWRunner(2)
    try:
        units = tuple(range(len(host.layout.units)))
        sink = CompactAdamW(host, runner, cfg.optim, 10)
        updates = StreamedUpdates(dev, CpuBackend(1, 1, torch.float32), units, cfg.optim, 10, timeout_s=60)
        gen = torch.Generator().manual_seed(0)
        for step in range(3):
            grads = {u: torch.randn(host.layout.templates[u].numel, generator=gen) for u in units}
            sq = [torch.dot(g, g) for g in grads.values()]
            coef = min(1.0, cfg.optim.max_grad_norm / (math.sqrt(sum(float(s) for s in sq)) + 1e-6))
            assert coef < 1.0
            for u in units:
                sink.update(u, grads[u].clone(), coef, step)
                updates.take_grad(u, grads[u].clone())
            updates.end_step(step, sq, sync=False, for_checkpoint=False)
            updates.join()  # the updater thread's work done
            for u in units:
                for kind in (*STATE_KINDS, "stream"):
                    assert torch.equal(host.block(kind, u), dev.block(kind, u)), (step, u, kind)
                for kind in SCALE_KINDS:
                    assert torch.equal(host.scale_block(kind, u), dev.scale_block(kind, u)), (step, u, kind)
                assert dev.version(u) == step + 1
        assert not torch.equal(dev.block("exp_avg", 0), torch.zeros_like(dev.block("exp_avg", 0)))  # it moved
        updates.close()
    finally:
        runner.close()
        for p in stores:
            p.close()


def test_the_write_back_waits_while_a_checkpoint_reads_an_earlier_boundary_and_holds_its_own(shm_dir):
    cfg = load_config(None, [f"memory.shm_dir={shm_dir}", "compute.device=cpu"])
    ps = _store(shm_dir, "copy", cfg)
    store = ps.store
    try:
        units = (1, 2)
        updates = StreamedUpdates(store, CpuBackend(1, 1, torch.float32), units, cfg.optim, 10, timeout_s=60)

        def step(at: int, for_checkpoint: bool) -> None:
            for u in units:
                updates.take_grad(u, torch.full((store.layout.templates[u].numel,), 0.01))
            updates.end_step(at, [torch.tensor(1.0)], sync=for_checkpoint, for_checkpoint=for_checkpoint)
            updates.join()  # the updater thread's work done (it waits for the checkpoint's copy)

        step(0, for_checkpoint=True)
        assert store.checkpoint_copy() == 1  # held for the checkpoint of boundary 1
        at_1 = store.block("master", 1).clone()
        ahead = threading.Thread(target=step, args=(1, False))
        ahead.start()
        ahead.join(timeout=0.5)
        assert ahead.is_alive() and torch.equal(store.block("master", 1), at_1) and store.version(1) == 1
        store.set_checkpoint_copy(None)  # the writer has written them
        ahead.join(timeout=60)
        assert not ahead.is_alive() and store.version(1) == 2 and not torch.equal(store.block("master", 1), at_1)
        assert store.checkpoint_copy() is None
        store.set_checkpoint_copy(3)  # a copy of the same boundary (the resident units', just made) is no wait
        step(2, for_checkpoint=True)
        assert store.version(2) == 3 and store.checkpoint_copy() == 3
        updates.close()
    finally:
        ps.close()


@pytest.fixture(scope="module")
def host_run(ray_cluster, tmp_path_factory, shm_dirs):
    """A: the host update, a checkpoint after every step."""
    base = tmp_path_factory.mktemp("host")
    with shm_dirs() as shm_dir:
        return train(_cfg(shm_dir, base, "train.checkpoint_every=1", f"train.keep_checkpoints={STEPS}"),
                     log=lambda line: None)


@pytest.mark.parametrize("extra", [(DEVICE,), (DEVICE, "memory.resident=embed_head")])
def test_checkpoints_interrupt_resume_and_export_with_device_updates_match_the_host_run(extra, host_run, shm_dir,
                                                                                       tmp_path):
    a_ckpts = os.path.join(host_run.run_dir, "checkpoints")
    # B: the updates on the device, a checkpoint every step (the sink waits for the worker's write-backs
    # before each; the worker's next write-back waits until the checkpoint has written the last),
    # interrupted once step 2's is out.
    lines = []
    with pytest.raises(Interrupted) as info:
        train(_cfg(shm_dir, tmp_path / "b", *extra, "train.checkpoint_every=1", f"train.keep_checkpoints={STEPS}"),
              log=interrupt_after_checkpoint(2, lines))
    boundary = checkpoint.read_meta(info.value.checkpoint)["step"]
    assert 2 <= boundary < STEPS, lines
    b_run = os.path.dirname(os.path.dirname(info.value.checkpoint))
    b_ckpts = sorted(os.listdir(os.path.join(b_run, "checkpoints")))
    assert b_ckpts == [f"step-{s:06d}" for s in range(1, boundary + 1)], b_ckpts
    for name in b_ckpts:  # weights and AdamW states of every unit
        ours = read_tensors(os.path.join(b_run, "checkpoints", name))
        theirs = read_tensors(os.path.join(a_ckpts, name))
        assert any("exp_avg" in k for k in ours)
        assert not differing(ours, theirs), (name, differing(ours, theirs)[:4])

    # C: resume B (its newest checkpoint) in place, the updates on the device again, to the end.
    assert cli.main(["train", "--resume", b_run]) == 0
    c_run = Path(b_run)
    assert not differing(read_tensors(host_run.final_dir), read_tensors(c_run / "final"))  # the export at the end
    assert not differing(read_tensors(os.path.join(a_ckpts, f"step-{STEPS:06d}")),
                      read_tensors(c_run / "checkpoints" / f"step-{STEPS:06d}"))
    rows_a = [json.loads(line) for line in open(os.path.join(host_run.run_dir, "metrics.jsonl"))]
    rows_c = [json.loads(line) for line in open(c_run / "metrics.jsonl")]
    assert [(r["loss"], r["grad_norm"]) for r in rows_c] == [(r["loss"], r["grad_norm"]) for r in rows_a]
    assert sum(r["device_update_busy_s"] for r in rows_c) > 0
    assert os.listdir(shm_dir) == []


@pytest.mark.slow  # kills actors and restarts the pipeline
def test_a_killed_compute_worker_mid_run_restarts_from_the_checkpoint_and_still_ends_bit_for_bit(host_run, shm_dir,
                                                                                               tmp_path):
    """The compute worker dies while it may be writing its units back (the store is half a step on):
    the restart resumes from the last checkpoint; then the sink dies."""
    lines = []
    result = train(_cfg(shm_dir, tmp_path, DEVICE, "train.checkpoint_every=2", f"train.keep_checkpoints={STEPS}",
                        "cluster.max_restarts=2"), log=kill_in_turn(["compute", "grad-sink"], lines))
    assert sum(line.startswith("restart ") for line in lines) == 2, "\n".join(lines)
    assert not differing(read_tensors(host_run.final_dir), read_tensors(result.final_dir))
    assert not differing(read_tensors(os.path.join(host_run.run_dir, "checkpoints", f"step-{STEPS:06d}")),
                      read_tensors(os.path.join(result.run_dir, "checkpoints", f"step-{STEPS:06d}")))
    assert os.listdir(shm_dir) == []


@pytest.mark.parametrize("extra,says", [
    (("optim.placement=gpu",), "optim.placement must be one of host, device, auto, got 'gpu'"),
    ((DEVICE, "precision.master_dtype=bfloat16"), "optim.placement device needs fp32 master weights"),
    ((DEVICE, "parallel.compute_workers=2"), "optim.placement device needs one compute worker in the whole run "
     "(got 2 x 1)"),
    ((DEVICE, "lora.rank=4"), "optim.placement device has nothing to place with lora.rank 4"),
])
def test_settings_it_cannot_serve_are_refused_by_name(extra, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(None, list(extra))


def test_the_policy_of_a_streamed_unit_updated_on_the_device_and_the_ones_refused():
    assert STREAMED_ON_DEVICE == UnitPolicy("streamed", "device", "device")
    for weights, gradient, optimizer in (("streamed", "host", "device"), ("resident", "device", "exact"),
                                         ("streamed", "device", "exact")):
        with pytest.raises(ValueError):
            UnitPolicy(weights, gradient, optimizer)


def test_the_plan_says_where_each_update_runs_and_counts_the_held_gradients():
    host = resolve(load_config(None, ["compute.device=cpu"]), Facts("cpu"))
    dev = resolve(load_config(None, ["compute.device=cpu", DEVICE]), Facts("cpu"))
    n = len(dev.layout.units)
    assert dev.policies == (STREAMED_ON_DEVICE,) * n and STREAMED_ON_DEVICE not in host.policies
    assert dev.sink.updates == () and len(host.sink.updates) == n and not dev.store.hold_grads
    assert f"updated where: 0 units on the host's CPU threads, {n} streamed units on the device" in dev.describe()
    assert f"updated where: {n} units on the host's CPU threads, 0 streamed units on the device" in host.describe()
    numel = sum(t.numel for t in dev.layout.templates)
    assert (dev.updates.device_params, dev.updates.host_params) == (numel, 0)
    assert (host.updates.device_params, host.updates.host_params) == (0, numel)
    assert dev.updates.device_s > 0 == host.updates.device_s and host.updates.host_s > 0 == dev.updates.host_s
    assert "expected step time with them" in dev.describe()
    rows = {r.component: r.nbytes for r in _fixed_device_rows(load_config(None, ["compute.device=cpu", DEVICE]),
                                                               "cpu", 1)}
    held = [v for k, v in rows.items() if k.startswith(f"gradients of the {n} streamed units updated on the device")]
    assert held == [numel * 4]
    assert not any("updated on the device" in k for k in (r.component for r in _fixed_device_rows(
        load_config(None, ["compute.device=cpu"]), "cpu", 1)))


def _moe_run(*extra, gib: float = 139, layers: int = 8):
    """The Qwen3-30B-A3B shape at 8 layers, 4 x 4 x 4,096 tokens a step, planned for an H200 box (12
    AdamW threads: the pinning leaves AdamW 12 of its 16 CPUs): its host update (~4.4 G params)
    outlasts the GPU's step (~0.5 s of FLOPs)."""
    shape = [f"model.{k}={v}" for k, v in preset_shape("qwen3-30b-a3b", layers).items()]
    cfg = load_config(None, ["compute.device=cuda", *shape, "model.max_position_embeddings=4096", "train.seq_len=4096",
                             "train.micro_batch_size=4", "train.num_micro_batches=4", *extra])
    return resolve(cfg, Facts("cuda", device_bytes=int(gib * 2**30), host_bytes=2**40, device_tflops=989.0,
                              adamw_cpus=12))


def test_the_plan_of_the_8bit_state_on_a_gpu_counts_each_gradient_once():
    """On a GPU the 8-bit state holds the host units' gradients there for the norm (experimental.hold_grads);
    the units updated on the device keep their own fp32 gradients instead, counted once, with the 8-bit
    pieces (4 bytes per parameter each way) and the update's temporaries."""
    host, dev = (_moe_run("optim.state=8bit", f"optim.placement={p}") for p in ("host", "device"))
    rows = {p: {r.component: r.nbytes for r in run.memory.rows} for p, run in (("host", host), ("device", dev))}
    numel = dev.layout.num_params
    held = [v for k, v in rows["host"].items() if k.startswith("the step's gradients, held")]
    assert host.store.hold_grads and held == [numel * 2]  # bf16, every unit
    assert not any(k.startswith("the step's gradients, held") for k in rows["device"])  # every unit moved
    assert [v for k, v in rows["device"].items() if k.startswith("gradients of the")] == [numel * 4]
    assert any(k.startswith("the 8-bit update's temporaries") for k in rows["device"])
    assert (dev.updates.device_bytes_in, dev.updates.device_bytes_out) == (4 + 8 / 2048, 4 + 8 / 2048)


def test_auto_moves_the_first_streamed_layers_to_the_device_while_that_shortens_the_step_and_their_gradients_fit():
    """The device's updates run beside the next forward, which follows them: auto moves the units that
    forward needs first, and the host's, last, have the rest of it."""
    # memory.resident as its first fit (auto would make more layers resident here and leave the host nothing
    # to pace: test_resident.py), on 126 GiB of GPU memory, where the moved units' gradients take a kept layer's room
    one = ("memory.resident=embed_head", "memory.resident_layers=1")
    host, auto = (_moe_run(f"optim.placement={p}", *one, gib=126) for p in ("host", "auto"))
    moved = [u for u, p in enumerate(auto.policies) if p == STREAMED_ON_DEVICE]
    assert host.updates.host_s > host.pace.step_s and STREAMED_ON_DEVICE not in host.policies  # the host paces it
    streamed = [u.index for u in auto.layout.layers if u.index not in auto.schedule.resident]
    assert moved and moved == streamed[:len(moved)]  # the first streamed layers (layers.0 is resident)
    assert auto.updates.device_lead == (moved[-1] + 1) / len(auto.layout.units)
    assert auto.updates.step_s(auto.pace) < host.updates.step_s(host.pace)
    # their held gradients are counted, and fit the share of the device the plan allows
    assert device_total(auto.memory.rows) <= auto.facts.device_bytes * GPU_USABLE
    # the activations placed again beside them: the moved units' gradients took room kept layers had,
    # and the recompute that brings is in the pace the move was weighed with
    assert auto.decisions.placement.count(KEEP) < host.decisions.placement.count(KEEP)
    assert auto.pace.step_s > host.pace.step_s
    held = [r for r in auto.memory.rows if r.component.startswith(f"gradients of the {len(moved)} streamed units")]
    assert len(held) == 1 and held[0].nbytes == 4 * sum(auto.layout.templates[u].numel for u in moved)
    # The sink updates the others.
    assert auto.sink.updates == tuple(u for u in host.sink.updates if u not in moved)
    # Where the device update cannot serve the run (bf16 master weights with the exact state), auto
    # leaves every unit on the host (no refusal).
    assert STREAMED_ON_DEVICE not in _moe_run("optim.placement=auto", "precision.master_dtype=bfloat16").policies


def test_the_host_path_of_clipped_split_updates_starts_at_the_backward_s_end_and_waits_on_the_first_pass():
    """With clipping the sink's updates wait for the step's norm: they start at the backward's end, in
    the order the next forward needs the units, and that forward follows the first pass of the split
    update (the moments and the stream copy) as far as the last unit the host updates, from which the
    rest of the step follows. Without clipping each update runs as its gradient arrives, after the forward."""
    one = ("memory.resident=embed_head", "memory.resident_layers=1", "optim.placement=host")
    clipped, unclipped = _moe_run(*one), _moe_run(*one, "optim.max_grad_norm=0")
    u, p = clipped.updates, clipped.pace
    assert u.after_norm and not u.held and u.first_pass == pace.SPLIT_FIRST_PASS < 1
    assert u.gate_share == 8 / 10  # layers.7, the last the host updates, after 8 of the 10 units
    assert {q.optimizer for q in clipped.policies[2:-1]} == {"split"}  # layers 1-7, streamed
    assert u.host_path_s(p) == pytest.approx(pace.SPLIT_FIRST_PASS * u.host_s + p.step_s - 0.8 * p.forward_s)
    assert u.host_path_s(p) > p.step_s and u.step_s(p) == u.host_path_s(p)  # the host paces this run
    assert "after the step's backward (they wait for its norm)" in clipped.describe()
    v, q = unclipped.updates, unclipped.pace
    assert not v.after_norm and v.first_pass == 1.0 and {q.optimizer for q in unclipped.policies[2:-1]} == {"exact"}
    assert v.host_path_s(q) == pytest.approx(v.host_s + q.forward_s)
    # never shorter than the updates themselves, which the threads run one step at a time
    slow = dataclasses.replace(u, thread_rate=u.thread_rate / 10)
    assert slow.host_path_s(p) == pytest.approx(slow.host_s)


def test_auto_moves_units_of_the_8bit_state_whose_host_update_the_next_forward_waits_for():
    """The 8-bit state on a GPU holds the host units' gradients there for the step's norm: the sink's
    updates start at the step's end and the next forward follows them, so where they outlast that
    forward the step grows by the difference (the 36-layer Qwen3-30B-A3B shape at 262,144 tokens:
    23.1 G parameters, ~8 s of host updates on 12 threads). The device's updates run beside that
    forward too, leading it: on an H200 every unit's state crosses the link in less than the forward
    takes, so auto moves them all and the step is the GPU's; with less GPU memory than every unit's fp32
    gradient needs, it moves the first units and the host updates the rest, whose held bf16 gradients
    the plan counts beside the moved units' fp32 ones."""
    host, auto = (_moe_run("optim.state=8bit", f"optim.placement={p}", "train.num_micro_batches=16", layers=36)
                  for p in ("host", "auto"))
    assert host.store.hold_grads and auto.store.hold_grads and host.updates.held and auto.updates.held
    assert host.updates.thread_rate == pace.HOST_COMPACT_PARAMS_PER_THREAD_S
    # the host path paces the host-only run: its updates, then the step from the last unit they update
    # (the head, after 37 of the 38 units)
    assert host.updates.gate_share == 37 / 38
    assert host.updates.step_s(host.pace) == pytest.approx(host.updates.host_s + host.pace.step_s
                                                           - 37 / 38 * host.pace.forward_s)
    assert host.updates.step_s(host.pace) > host.pace.step_s
    n = len(auto.layout.units)
    assert auto.schedule.resident == () and auto.policies == (STREAMED_ON_DEVICE,) * n and auto.sink.updates == ()
    u = auto.updates
    assert u.device_lead == 1 and 0 < u.device_s < auto.pace.forward_s and u.device_wait_s(auto.pace) == 0
    assert u.step_s(auto.pace) == pytest.approx(auto.pace.step_s - pace.HOST_PARAM_S * auto.layout.num_params)
    assert device_total(auto.memory.rows) <= auto.facts.device_bytes * GPU_USABLE
    assert not any(r.component.startswith("the step's gradients, held") for r in auto.memory.rows)
    # Less GPU memory: the first units move, the host updates the others after them.
    part = _moe_run("optim.state=8bit", "optim.placement=auto", "train.num_micro_batches=16", layers=36, gib=110)
    moved = [u for u, p in enumerate(part.policies) if p == STREAMED_ON_DEVICE]
    assert 0 < len(moved) < n and moved == list(range(len(moved)))  # the embedding first
    assert part.updates.step_s(part.pace) < host.updates.step_s(host.pace)
    assert device_total(part.memory.rows) <= part.facts.device_bytes * GPU_USABLE
    rows = {r.component: r.nbytes for r in part.memory.rows}
    on_device = sum(part.layout.templates[u].numel for u in moved)
    assert [v for k, v in rows.items() if k.startswith("the step's gradients, held")] == [
        2 * (part.layout.num_params - on_device)]
    assert [v for k, v in rows.items() if k.startswith(f"gradients of the {len(moved)} streamed units")] == [
        4 * on_device]
    assert "after the step's backward (its gradients held on the device for the norm)" in part.describe()


def test_auto_keeps_every_update_on_the_host_where_the_step_hides_it_and_on_the_cpu():
    shape = [f"model.{k}={v}" for k, v in preset_shape("7b").items()]
    cfg = load_config(None, ["compute.device=cuda", *shape, "optim.placement=auto", "model.max_position_embeddings=4096",
                             "train.seq_len=4096", "train.micro_batch_size=4", "train.num_micro_batches=4"])
    dense = resolve(cfg, Facts("cuda", device_bytes=139 * 2**30, host_bytes=2**40, device_tflops=989.0, adamw_cpus=12))
    assert dense.updates.host_s < dense.pace.step_s and STREAMED_ON_DEVICE not in dense.policies
    cpu = resolve(load_config(None, ["compute.device=cpu", "optim.placement=auto"]), Facts("cpu"))
    assert STREAMED_ON_DEVICE not in cpu.policies
