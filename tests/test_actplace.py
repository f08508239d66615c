"""Per-layer activation placement (kept whole / checkpoint on the device / checkpoint on the host),
its planner, and the attention-backend setting, on the CPU.

The three placements run the same function on the same values: a kept graph is the one the
recompute would rebuild (same input, same weights, same ops, and eager CPU kernels are
deterministic), an offloaded checkpoint comes back with the same bytes. So losses and gradients
must agree bit for bit, not to a tolerance.
"""

import contextlib
import dataclasses
import os
import queue
import re
import threading
import uuid

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from saved_bytes import layer_inputs, saved_bytes

from megatrain_ray import cli
from megatrain_ray.config import load_config
from megatrain_ray.data.loader import source_from_config
from megatrain_ray.engine.compute.activations import GPU, HOST, KEEP, kept_bytes_per_token, layer_modes, recompute_spans
from megatrain_ray.engine.compute.attention import sdpa_backend
from megatrain_ray.engine.compute.compute_worker import ComputeWorker
from megatrain_ray.engine.prefetch.prefetcher import Prefetcher
from megatrain_ray.engine.schedule import Schedule
from megatrain_ray.engine.compute.sequence import LayerRunner
from megatrain_ray.engine.store.host_store import HostStore, ParameterStore, StoreSpec
from megatrain_ray.errors import ConfigError
from megatrain_ray.model import transformer as M
from megatrain_ray.model.layout import LayerTemplate, StoreLayout
from megatrain_ray.model.precision import resolve_precision
from megatrain_ray.orchestration import preflight
from megatrain_ray.orchestration.resolve import Facts, resolve

SMALL = ["model.hidden_size=64", "model.intermediate_size=176", "model.num_hidden_layers=3",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=512"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_kept_graph_bytes_match_what_autograd_saves(dtype, qk_norm):
    """kept_bytes_per_token is exactly what a layer's forward saves (counted with saved-tensor
    hooks, one count per storage; weights and the step's RoPE cache left out) plus its input."""
    cfg = load_config(None, SMALL + (["model.model_type=qwen3", "model.head_dim=32"] if qk_norm else [])).model
    assert cfg.qk_norm == qk_norm
    b, s = 2, 96
    leaves, x, rope = layer_inputs(cfg, dtype, b, s)
    assert saved_bytes(M.decoder_layer, leaves, x, rope, cfg) == b * s * kept_bytes_per_token(cfg, dtype.itemsize)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
@pytest.mark.parametrize("lean", [True, False])
def test_compiled_kept_graph_bytes_match_what_the_partitioner_saves(lean, family, dtype):
    """The compiled figure against what CompiledLayer's training graph saves, under its partitioner
    settings (lean, the default) or torch's, for a Llama-shaped layer, with qk_norm (qwen3) and with
    q/k/v biases (qwen2): AOTAutograd with Inductor's partitioner (min-cut rematerialisation) and no
    code generation, so the saved set is Inductor's (checked against the inductor backend on this
    CPU for each case here: the same bytes) in seconds. Lean, the backward recomputes elementwise
    work only: as many GEMMs as with torch's settings (2 per fused projection: input and weight
    gradients), no attention forward."""
    from megatrain_ray.engine.compute.activations import LEAN_PARTITIONER
    from megatrain_ray.engine.compute.compute_worker import CompiledLayer

    extra = ["model.head_dim=32"] if family == "qwen3" else []
    cfg = load_config(None, SMALL + [f"model.model_type={family}", *extra]).model
    assert cfg.qk_norm == (family == "qwen3") and cfg.attention_bias == (family == "qwen2")
    b, s = 2, 96
    leaves, x, rope = layer_inputs(cfg, dtype, b, s)
    backward_graphs = []
    torch._dynamo.reset()
    layer = CompiledLayer(backend=_min_cut_backend(backward_graphs), partitioner=LEAN_PARTITIONER if lean else None)
    skip = {v.untyped_storage().data_ptr() for v in (*leaves.values(), *rope)}
    saved = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes()}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in skip:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = layer(leaves, x, rope, cfg)
    y.sum().backward()
    assert layer.failure is None
    assert sum(saved.values()) == b * s * kept_bytes_per_token(cfg, dtype.itemsize, compiled=True, lean=lean)
    ops = [str(n.target) for n in backward_graphs[0].graph.nodes if n.op == "call_function"]
    gemms = sum(op in ("aten.mm.default", "aten.addmm.default", "aten.bmm.default") for op in ops)
    # 2 per projection (fused: 4), as with torch's settings; with q/k/v biases, op by op, the
    # fused q/k/v projection's are taken per member (6 instead of 2), also as with torch's settings
    assert gemms == (12 if cfg.attention_bias else 8)
    assert not [op for op in ops if "attention" in op and "backward" not in op]
    torch._dynamo.reset()


def test_the_lean_partitioner_saves_33_percent_at_the_7b_shape_where_torch_has_its_settings(monkeypatch):
    """At the Qwen2.5-7B shape (fused projections, q/k/v biases) a compiled kept layer holds 106616
    bytes per token with the lean settings, 158840 with torch's (both measured with the inductor
    backend on this CPU); a torch without one of the settings gets its default partitioner and the
    figure that goes with it."""
    from megatrain_ray.engine.compute import activations
    from megatrain_ray.model.presets import preset_model

    cfg = preset_model("7b")
    assert kept_bytes_per_token(cfg, 2, compiled=True, lean=True) == 106616
    assert kept_bytes_per_token(cfg, 2, compiled=True, lean=False) == 158840
    assert activations.lean_partitioner() == activations.LEAN_PARTITIONER  # this torch has them
    assert kept_bytes_per_token(cfg, 2, compiled=True) == 106616
    monkeypatch.setattr(activations, "LEAN_PARTITIONER", {**activations.LEAN_PARTITIONER, "not_in_this_torch": False})
    assert activations.lean_partitioner() is None
    assert kept_bytes_per_token(cfg, 2, compiled=True) == 158840


def _min_cut_backend(backward_graphs=None):
    """torch.compile through AOTAutograd with Inductor's partitioner and no code generation
    (backward graphs appended to ``backward_graphs``)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def backward(gm, _):
        if backward_graphs is not None:
            backward_graphs.append(gm)
        return gm

    return aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=backward,
                        partition_fn=min_cut_rematerialization_partition)


def _cpu_step(cfg, shm_dir, placement, attention_backend="auto", calls=None, fail_at=None, wrap=None):
    """One step through store + prefetcher + compute worker on the CPU; returns (loss, {unit: grads}, result)."""
    spec = StoreSpec(cfg.model, resolve_precision(cfg.precision, "cpu"), shm_dir, os.getpid(), "ap-" + uuid.uuid4().hex[:6])
    ParameterStore(spec, cfg.train.seed)
    depth = cfg.memory.buffer_depth_on("cpu")
    fetch_q, release_q, grad_q = queue.Queue(depth), queue.Queue(depth), queue.Queue()
    prefetcher = Prefetcher(spec, Schedule.build(StoreLayout.build(cfg.model), cfg.model.tie_word_embeddings, (),
                                              recompute_spans(placement)), depth, fetch_q, release_q, cfg.cluster.actor_timeout_s)
    thread = threading.Thread(target=prefetcher.run, args=(0, 1), daemon=True)
    thread.start()
    worker = None
    try:  # the thread ends whatever happens, a worker that cannot be built included
        settings = dataclasses.replace(resolve(cfg, Facts("cpu")).compute, activations=placement,
                                       attention_backend=attention_backend, threads=None)
        worker = ComputeWorker(spec, settings, fetch_q, grad_q, release_q)
        if wrap is not None:  # the layer's functions wrapped (compiled) as the worker does with compute.compile
            worker.runner = LayerRunner(0, wrap)
        if calls is not None:  # count the layer's forward runs (forward, and recompute up to the down projection)
            def counting(inner):
                def counted(*args):
                    calls.append(1)
                    if len(calls) == fail_at:  # as torch raises when the device's memory is exhausted
                        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.50 GiB")
                    return inner(*args)
                return counted
            worker.runner.layer, worker.runner.to_down = counting(worker.runner.layer), counting(worker.runner.to_down)
        result = worker.run_step(0, source_from_config(cfg).batch(0))
    finally:
        if worker is not None:
            worker.close()
        finish_prefetch(prefetcher, thread, fetch_q, release_q)
    return result, step_grads(spec, grad_q)


def finish_prefetch(prefetcher, thread, fetch_q, release_q) -> None:
    """Let the prefetcher's thread end: after a step that failed part-way it waits for slots the
    closed worker will never release or for room on the fetch queue, so take its tickets and give it
    slots (any id serves: nothing reads the slots now) until it has issued the step (step 0 waits on
    no update)."""
    while thread.is_alive():
        with contextlib.suppress(queue.Empty):
            fetch_q.get_nowait()
        with contextlib.suppress(queue.Full):
            release_q.put_nowait(0)
        thread.join(timeout=0.01)


def step_grads(spec, grad_q) -> dict[int, dict[str, torch.Tensor]]:
    """The gradients one compute worker's step sent, {unit: {name: fp32 copy}}, read from the store
    as its tickets arrive."""
    store = HostStore(spec)
    grads = {}
    for _ in store.layout.units:
        ticket = grad_q.get(timeout=30)
        grads[ticket.unit] = {k: v.float().clone() for k, v in store.params("grad", ticket.unit).items()}
    return grads


def _config(tmp_path, shm_dir, *extra):
    data = tmp_path / "tokens.npy"
    if not data.exists():
        np.save(data, np.random.default_rng(0).integers(0, 512, size=20_000))
    return load_config(None, SMALL + ["train.seq_len=32", "train.micro_batch_size=2", "train.num_micro_batches=3",
                                      "train.steps=1", f"data.path={data}", "compute.device=cpu",
                                      f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path}", *extra])


def test_every_placement_gives_the_recompute_path_s_loss_and_gradients_bit_for_bit(tmp_path, shm_dir):
    cfg = _config(tmp_path, shm_dir)
    placements = {"recompute": (GPU,) * 3, "offload": (HOST,) * 3, "keep": (KEEP,) * 3,
                  "mixed": layer_modes(3, 1, 1), "keep two": layer_modes(3, 2, 0)}
    assert placements["mixed"] == (HOST, GPU, KEEP)
    runs = {}
    for name, placement in placements.items():
        calls = []
        runs[name] = _cpu_step(cfg, shm_dir, placement, calls=calls)
        # every layer runs forward once per micro-batch, and again in the backward unless kept
        assert len(calls) == 3 * (3 + sum(mode != KEEP for mode in placement)), name
    ref_result, ref_grads = runs["recompute"]
    for name, (result, grads) in runs.items():
        assert result["loss"] == ref_result["loss"], name
        assert result["fetches"] == ref_result["fetches"]  # every layer still crosses the link twice
        assert grads.keys() == ref_grads.keys()
        for unit, named in grads.items():
            for key, g in named.items():
                assert torch.equal(g, ref_grads[unit][key]), f"{name}: unit {unit} {key}"
        moved = sum(n for lane, label, _, _, n in result["intervals"] if lane == "d2h" and "inputs" in label)
        offloaded = sum(mode == HOST for mode in placements[name])
        assert moved == offloaded * 3 * 2 * 32 * 64 * 4  # micro-batches x [2, 32, 64] fp32 per offloaded layer
    assert any(float(g.abs().sum()) > 0 for g in ref_grads[1].values())


def test_running_out_of_device_memory_with_kept_graphs_says_what_to_set(tmp_path, shm_dir):
    from megatrain_ray.errors import PipelineError

    cfg = _config(tmp_path, shm_dir)
    with pytest.raises(PipelineError, match=r'with 2 layers\' activations kept whole; keep fewer \(memory.activations: '
                                            r'counts, memory.kept_layers: 1\) or set memory.activations to recompute'):
        _cpu_step(cfg, shm_dir, layer_modes(3, 2, 0), calls=[], fail_at=7)
    with pytest.raises(torch.OutOfMemoryError):  # nothing kept: torch's own error stands
        _cpu_step(cfg, shm_dir, (GPU,) * 3, calls=[], fail_at=7)


def test_kept_graphs_of_the_compiled_layer_train_as_its_recompute(tmp_path, shm_dir):
    """The compiled layer (CompiledLayer, here without code generation: the partitioned forward and
    backward graphs run op by op) kept whole gives the recompute's loss and gradients bit for bit
    (the recompute is a graph of its own, the layer up to its down projection, whose backward the
    runner does by hand) and compiles one graph more: the kept forward's, once for every kept
    layer; its partitioner settings (applied with gradients on) cause no recompile. With torch's own
    partitioner settings, the same values bit for bit: what the lean ones recompute in the
    backward are the same ops on the same values as the forward that saved them otherwise. (With
    the inductor backend on this CPU, checked once by hand: also bit for bit.)"""
    from megatrain_ray.engine.compute.compute_worker import CompiledLayer

    cfg = _config(tmp_path, shm_dir)
    torch._dynamo.reset()
    compiled = {}

    def wrap(fn, partitioner="lean"):  # one compiled callable per function and settings, as one worker has
        key = (fn, partitioner)
        compiled[key] = compiled.get(key) or CompiledLayer(backend=_min_cut_backend(), fn=fn, partitioner=partitioner)
        return compiled[key]
    from torch._dynamo.utils import counters

    from megatrain_ray.engine.compute.activations import LEAN_PARTITIONER

    ref, ref_grads = _cpu_step(cfg, shm_dir, (GPU,) * 3, wrap=wrap)
    assert all(c.training_config == LEAN_PARTITIONER for c in compiled.values())  # lean: this torch has them
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 2  # the no-grad forward, the recompute's training graph
    got, grads = _cpu_step(cfg, shm_dir, layer_modes(3, 2, 1), wrap=wrap)
    assert counters["stats"]["unique_graphs"] == graphs + 1  # and the kept forward's, once for both kept layers
    torch._dynamo.reset()
    runs = [(got, grads), _cpu_step(cfg, shm_dir, layer_modes(3, 2, 1), wrap=lambda fn: wrap(fn, None))]
    assert all(c.failure is None for c in compiled.values())
    for got, grads in runs:
        assert got["loss"] == ref["loss"]
        for unit, named in grads.items():
            for key, g in named.items():
                assert torch.equal(g, ref_grads[unit][key]), f"unit {unit} {key}"
    torch._dynamo.reset()


class _Ops(TorchDispatchMode):
    """The aten ops run under it (this thread)."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_attention_backend_is_honoured_and_keeps_the_math(tmp_path, shm_dir):
    """math and flash (CPU) run different kernels for the same attention; the worker runs its setting."""
    cfg = load_config(None, SMALL).model
    t = LayerTemplate.build(cfg, "layers.0")
    params = t.bind(torch.randn(t.numel) * 0.05, fused=True)
    x = torch.randn(2, 64, cfg.hidden_size)
    rope = M.rope_cache(cfg, 64, torch.device("cpu"), torch.float32)
    outs = {}
    for name in ("auto", "flash", "math"):
        with _Ops() as rec, sdpa_backend(name):
            outs[name] = M.decoder_layer(params, x, rope, cfg)
        assert ("aten._scaled_dot_product_flash_attention_for_cpu" in rec.ops) == (name != "math"), name
    assert torch.equal(outs["auto"], outs["flash"])  # torch's CPU choice is the flash kernel
    # fp32, another summation order of a softmax over 64 keys and its weighted sum: ~1e-7 relative
    # per element, far below the 1e-5 bound; a wrong mask or scale would be off by O(1)
    torch.testing.assert_close(outs["math"], outs["flash"], rtol=1e-5, atol=1e-6)

    run = _config(tmp_path, shm_dir)
    losses = {}
    for name in ("auto", "math"):
        with _Ops() as rec:
            losses[name] = _cpu_step(run, shm_dir, (GPU,) * 3, attention_backend=name)[0]["loss"]
        assert ("aten._scaled_dot_product_flash_attention_for_cpu" in rec.ops) == (name == "auto"), name
    assert losses["math"] == pytest.approx(losses["auto"], rel=1e-5)
    with pytest.raises(ConfigError, match="compute.attention_backend 'cudnn' is not available on cpu"):
        _cpu_step(run, shm_dir, (GPU,) * 3, attention_backend="cudnn")


def test_memory_activations_settings_and_their_errors():
    def counts(*extra, device="cuda"):
        return load_config(None, SMALL + list(extra)).memory.activation_counts(device, 3)

    assert counts() is None and counts(device="cpu") == (0, 0, 0)  # auto: the planner's on cuda, recompute on cpu
    assert counts("memory.activations=recompute") == (0, 0, 0)
    assert counts("memory.activations=offload") == (0, 3, 0)
    assert counts("memory.activations=keep") == (3, 0, 0)
    counted = "memory.activations=counts"
    assert counts(counted, "memory.kept_layers=2", "memory.offloaded_layers=1") == (2, 1, 0)
    assert counts(counted, "memory.offloaded_layers=2") == (0, 2, 0) and counts(counted) == (0, 0, 0)
    assert counts(counted, "memory.offloaded_layers=1", "memory.spanned_layers=1") == (0, 1, 1)
    for bad, says in ((["memory.activations=some"], "memory.activations must be auto, recompute, offload, "
                                                    "keep or counts, got 'some'"),
                      (["memory.kept_layers=x"], "memory.kept_layers must be an integer, got 'x'"),
                      ([counted, "memory.kept_layers=-1"], "memory.kept_layers must be >= 0, got -1"),
                      (["memory.kept_layers=2"], "memory.kept_layers (2) is read only with memory.activations counts "
                                                 "(got 'auto')"),
                      (["memory.activations=keep", "memory.offloaded_layers=1"], "memory.offloaded_layers (1) is "
                                                                                 "read only with memory.activations"),
                      ([counted, "memory.kept_layers=3", "memory.offloaded_layers=1"],
                       "memory.activations (counts: 3 kept, 1 offloaded, 0 spanned) places more layers than the "
                       "model has (3)"),
                      ([counted, "memory.offloaded_layers=2", "memory.spanned_layers=2"], "memory.activations (counts"),
                      ([counted, "memory.kept_layers=1", "memory.spanned_layers=2"],
                       "memory.spanned_layers (2) leaves no checkpoint for a recompute span to start from"),
                      (["compute.attention_backend=fast"], "compute.attention_backend")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(None, SMALL + bad)


def _seven_b(tokens_per_mb: int, micro_batches: int, *extra):
    import dataclasses

    from megatrain_ray.model.presets import preset_model
    return load_config(None, [f"train.seq_len={min(tokens_per_mb, 4096)}",
                              f"train.micro_batch_size={max(1, tokens_per_mb // 4096)}",
                              f"train.num_micro_batches={micro_batches}", *extra],
                       base={"model": dataclasses.asdict(preset_model("7b"))})


def test_the_planner_keeps_graphs_in_free_gpu_memory_and_offloads_only_what_does_not_fit():
    """auto fills the usable GPU memory: every checkpoint first, then whole graphs layer by layer
    while one more fits; where the checkpoints do not fit, the fewest layers go to host memory."""
    gib = 2**30
    # the benchmark's 7B step (64k tokens), its memory.resident (auto) resolved as a run resolves it
    cfg = _seven_b(16384, 4)
    run = resolve(cfg, Facts("cuda", 140 * gib, adamw_cpus=12))  # the H200 box's 12 AdamW threads
    assert run.resident_layers == 1
    resident = run.schedule.resident
    modes = run.compute.activations
    assert modes == preflight.activation_placement(cfg, "cuda", 140 * gib, resident)
    keep = modes.count(KEEP)
    assert 0 < keep < 28 and HOST not in modes and modes[-keep:] == (KEEP,) * keep

    def device_total(k, h):
        rows = preflight._fixed_device_rows(cfg, "cuda", 4, resident) + preflight._activation_rows(cfg, "cuda", 4, k, h)
        return preflight.device_total(rows)  # the layer and the head phases never overlap

    usable = 140 * gib * preflight.GPU_USABLE
    assert device_total(keep, 0) <= usable < device_total(keep + 1, 0)
    plan = run.memory
    assert plan.total("device") == device_total(keep, 0)
    assert f"{keep} layers kept whole on the GPU" in plan.table()

    run = resolve(cfg, Facts("cuda", 24 * gib, host_bytes=120 * gib, adamw_cpus=12))  # a 128 GiB box's host RAM: room to offload
    assert run.resident_layers is None  # what it would hold on the GPU would push checkpoints out
    resident = ()
    small = run.compute.activations  # not even every checkpoint fits
    host = small.count(HOST)
    assert KEEP not in small and 0 < host < 28 and small[:host] == (HOST,) * host
    assert device_total(0, host) <= 24 * gib * preflight.GPU_USABLE < device_total(0, host - 1)
    assert preflight.activation_placement(cfg, "cuda", 10_000 * gib) == (KEEP,) * 28
    assert preflight.activation_placement(cfg, "cpu", None) == (GPU,) * 28  # auto on the CPU: recompute
    explicit = _seven_b(16384, 4, "memory.activations=counts", "memory.kept_layers=3", "memory.offloaded_layers=5")
    assert preflight.activation_placement(explicit, "cuda", 48 * gib) == layer_modes(28, 3, 5)


def test_plan_prints_the_placement(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plan", "--device", "cuda", "--gpu-memory", "140", "--set", "model.num_hidden_layers=4",
                     "--set", "train.seq_len=1024"]) in (0, 2)  # this box's host RAM is not the question
    out = capsys.readouterr().out
    assert "4 layers kept whole on the GPU" in out and "activations kept whole (4 layers" in out
    assert cli.main(["plan", "--device", "cuda", "--gpu-memory", "140", "--set", "model.num_hidden_layers=4",
                     "--set", "memory.activations=counts", "--set", "memory.kept_layers=1",
                     "--set", "memory.offloaded_layers=2"]) in (0, 2)
    out = capsys.readouterr().out
    assert ("activations (as memory.activations='counts' sets): 1 layers kept whole on the GPU" in out
            and "1 checkpointed on the GPU" in out and "2 offloaded to host RAM" in out)


@pytest.mark.slow  # two Ray runs of two workers
def test_two_workers_with_kept_and_offloaded_layers_train_what_one_recomputing_worker_does(
        ray_cluster, tmp_path, shm_dir):
    """Data parallel with a mixed placement: each worker keeps one layer whole and offloads another;
    the gradients are all-reduced per unit as before. The only difference from one worker is the
    order of the micro-batch sums (see tests/test_data_parallel.py for the 1e-5 bound)."""
    from megatrain_ray.orchestration.pipeline import train

    base = SMALL + ["train.seq_len=32", "train.micro_batch_size=2", "train.num_micro_batches=4", "train.steps=3",
                    "compute.device=cpu", f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path / 'runs'}",
                    "train.checkpoint_every=0", "train.save_final=false", "cluster.actor_timeout_s=120"]
    one = train(load_config(None, base + ["memory.activations=recompute"]), log=lambda line: None)
    two = train(load_config(None, base + ["parallel.compute_workers=2", "memory.activations=counts", "memory.kept_layers=1", "memory.offloaded_layers=1"]),
                log=lambda line: None)
    np.testing.assert_allclose(two.losses, one.losses, rtol=1e-5)
    np.testing.assert_allclose(two.grad_norms, one.grad_norms, rtol=1e-5)
    assert two.losses[-1] < two.losses[0]
