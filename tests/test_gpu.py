"""GPU checks of the streamed bf16 path against the same model trained GPU-resident (skipped without CUDA).

One training step of a small Llama-shaped model through the real store, prefetcher and compute
worker (the gradient sink left out, so the gradients stay in the host store to be read back),
against the same weights held on the GPU in fp32 and run under bf16 autocast with plain autograd.
"""

import dataclasses
import gc
import os
import queue
import threading
import uuid

import numpy as np
import pytest
import torch

from megatrain_ray.config import load_config
from megatrain_ray.data.loader import source_from_config
from megatrain_ray.engine.compute.activations import GPU, HOST
from megatrain_ray.engine.compute.compute_worker import ComputeWorker
from megatrain_ray.engine.prefetch.prefetcher import Prefetcher
from benchmarks.reference import ResidentModel
from megatrain_ray.engine.schedule import Schedule
from megatrain_ray.engine.store.host_store import HostStore, ParameterStore, StoreSpec
from megatrain_ray.model.layout import StoreLayout
from megatrain_ray.model.precision import resolve_precision
from megatrain_ray.orchestration.resolve import Facts, resolve

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _config(tmp_path, shm_dir, tied: bool, layers: int = 4):
    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(0).integers(0, 4096, size=200_000))
    return load_config(None, [
        "model.hidden_size=256", "model.intermediate_size=704", f"model.num_hidden_layers={layers}",
        "model.num_attention_heads=8", "model.num_key_value_heads=2", "model.vocab_size=4096",
        f"model.tie_word_embeddings={str(tied).lower()}", "train.seq_len=256", "train.micro_batch_size=4",
        "train.num_micro_batches=3", "train.steps=1", f"data.path={data}", "compute.device=cuda",
        f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path}/runs", "memory.loss_chunk_size=300"])


def _streamed_step(cfg, compile_layers: bool, offload: bool = False, mlp_chunk: int = 0):
    """One step through store + prefetcher + compute worker; returns (result, store, spec)."""
    spec = StoreSpec(cfg.model, resolve_precision(cfg.precision, "cuda"), cfg.memory.shm_dir, os.getpid(), "gpu-" + uuid.uuid4().hex[:6])
    ParameterStore(spec, cfg.train.seed)
    depth = cfg.memory.buffer_depth_on("cuda")
    fetch_q, release_q, grad_q = queue.Queue(depth), queue.Queue(depth), queue.Queue()
    prefetcher = Prefetcher(spec, Schedule.build(StoreLayout.build(cfg.model), cfg.model.tie_word_embeddings), depth,
                            fetch_q, release_q, cfg.cluster.actor_timeout_s)
    thread = threading.Thread(target=prefetcher.run, args=(0, 1), daemon=True)
    thread.start()
    settings = dataclasses.replace(resolve(cfg, Facts("cuda")).compute, compile=compile_layers,
                                   activations=(HOST if offload else GPU,) * cfg.model.num_hidden_layers,
                                   mlp_chunk_size=mlp_chunk)
    worker = ComputeWorker(spec, settings, fetch_q, grad_q, release_q)
    try:
        result = worker.run_step(0, source_from_config(cfg).batch(0))
    finally:
        worker.close()
    thread.join(timeout=30)
    tickets = [grad_q.get(timeout=30) for _ in range(len(HostStore(spec).layout.units))]
    return result, tickets, spec


def _resident_step(cfg, store: HostStore):
    """The same step with every weight resident on the GPU in fp32 under bf16 autocast."""
    model = ResidentModel(cfg.model, [store.params("master", i) for i in range(len(store.layout.units))], "cuda",
                          autocast=torch.bfloat16)
    batch = source_from_config(cfg).batch(0)
    ids, labels = torch.tensor(batch["input_ids"]).cuda(), torch.tensor(batch["labels"]).cuda()
    n_tok = int((labels != -100).sum())
    total = sum(model.loss_backward(ids[m], labels[m], n_tok) for m in range(ids.shape[0]))
    return total, model.units


@pytest.mark.parametrize("tied,compile_layers,offload,mlp_chunk", [
    (False, False, False, 0), (True, False, False, 0), (False, True, False, 0), (False, False, True, 0),
    (False, True, True, 100)])  # the last: the MLP in chunks of 100 of the 256 tokens, compiled halves
def test_streamed_bf16_step_matches_the_gpu_resident_model(tied, compile_layers, offload, mlp_chunk, tmp_path,
                                                           shm_dir):
    cfg = _config(tmp_path, shm_dir, tied)  # the shm_dir fixture removes the segments afterwards
    result, tickets, spec = _streamed_step(cfg, compile_layers, offload, mlp_chunk)
    store = HostStore(spec)
    ref_loss, ref_units = _resident_step(cfg, store)
    n_layers = cfg.model.num_hidden_layers
    # each layer's weights crossed the link exactly twice (forward, backward), the head once, the
    # embedding once (twice when tied: it is also the LM head)
    assert result["fetches"] == {"layers": 2 * n_layers, "embed": 2 if tied else 1, "head": 1}
    assert abs(result["loss"] - ref_loss) / ref_loss < 1e-2
    sq_norm = 0.0
    for ticket in tickets:
        grads = store.params("grad", ticket.unit)
        assert ticket.sq_norm == pytest.approx(sum(float(g.float().pow(2).sum()) for g in grads.values()),
                                               rel=2e-2)
        sq_norm += ticket.sq_norm
        for name, g in grads.items():
            ref = ref_units[ticket.unit][name].grad.float().cpu()
            err = float((g.float() - ref).norm() / ref.norm().clamp_min(1e-12))
            assert err < 3e-2, f"{store.layout.units[ticket.unit]}.{name}: relative gradient error {err:.3g}"
    ref_sq = sum(float(p.grad.float().pow(2).sum()) for u in ref_units for p in u.values())
    assert sq_norm == pytest.approx(ref_sq, rel=2e-2)


def test_offloaded_activations_keep_device_memory_flat_in_depth(tmp_path, shm_dir):
    """With memory.activations offload the peak device memory of a step does not grow with the
    number of layers; kept on the device, it grows by one checkpoint set per layer."""
    peaks = {}
    for offload in (False, True):
        for layers in (2, 8):
            cfg = _config(tmp_path, shm_dir, False, layers)
            gc.collect()  # the previous worker's slots
            torch.cuda.reset_peak_memory_stats()
            peaks[offload, layers] = _streamed_step(cfg, False, offload)[0]["device_peak_bytes"]
    per_layer = 3 * 4 * 256 * 256 * 2  # micro-batches x [4, 256, 256] bf16
    assert peaks[False, 8] - peaks[False, 2] >= 6 * per_layer * 0.9
    assert abs(peaks[True, 8] - peaks[True, 2]) < 1.5 * per_layer


@pytest.mark.parametrize("compiled", [False, True])
def test_packed_documents_flex_attention_matches_the_dense_mask(compiled):
    """On CUDA packed documents run through FlexAttention (a BlockMask); the same layer with the
    dense [B, 1, S, S] mask through SDPA (the CPU path, exact there against per-document HF runs:
    tests/test_longctx.py) gives the same output and gradients within bf16 rounding (2e-2
    relative: a few bf16 ulps, 2^-8 each, through a layer), with and without the MLP tiled."""
    from megatrain_ray.engine.compute.compute_worker import CompiledLayer
    from megatrain_ray.engine.compute.sequence import LayerRunner, step_contexts
    from megatrain_ray.model import transformer as M
    from megatrain_ray.model.layout import LayerTemplate

    cfg = load_config(None, ["model.hidden_size=256", "model.intermediate_size=704", "model.num_attention_heads=8",
                             "model.num_key_value_heads=2", "model.max_position_embeddings=4096"]).model
    t = LayerTemplate.build(cfg, "layers.0")
    flat = (torch.randn(t.numel, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 0.05)
    for name, _, _ in t.params:
        if name.endswith("norm.weight"):
            t.bind(flat)[name].fill_(1.0)
    flat = flat.bfloat16()
    s = 2048
    pos = torch.cat([torch.arange(700), torch.arange(1000), torch.arange(348)]).cuda()[None, None]
    x = torch.randn(1, s, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    flex_ctx = step_contexts(cfg, pos, 1, s, torch.device("cuda"), torch.bfloat16)[0]
    dense_ctx = (flex_ctx[0], M.document_mask(pos[0]))
    assert not isinstance(flex_ctx[1], torch.Tensor)  # a BlockMask

    def run(runner, ctx):
        with torch.no_grad():
            y = runner.forward(t.bind(flat, fused=True), x, ctx, cfg)
        grad = torch.zeros(t.numel, device="cuda")
        leaves = {k: w.detach().requires_grad_(True) for k, w in t.bind(flat, fused=True).items()}
        return y.float(), runner.backward(leaves, t.bind(grad, fused=True), x, dy, ctx, cfg).float(), grad

    wrap = (lambda fn: CompiledLayer(fn=fn)) if compiled else None
    want = run(LayerRunner(0), dense_ctx)
    for runner in (LayerRunner(0, wrap), LayerRunner(512, wrap)):
        for g, w in zip(run(runner, flex_ctx), want):
            assert float((g - w).norm() / w.norm()) < 2e-2


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("chunk", [0, 512])
def test_packed_documents_flex_attention_is_each_document_alone_through_sdpa(compiled, chunk):
    """Packed documents through FlexAttention (its BlockMask) against each document run alone
    through plain causal SDPA, both in bf16 and both measured against the per-document run in
    float64 (tests/test_longctx.py, packed_against_each_document): the packed path may deviate by
    at most twice what the per-document bf16 run itself deviates (the two kernels block and sum
    differently; a wrong mask or position is an O(1) error). The CPU runs it with the dense mask."""
    from megatrain_ray.engine.compute.compute_worker import CompiledLayer
    from test_longctx import packed_against_each_document

    wrap = (lambda fn: CompiledLayer(fn=fn)) if compiled else None
    packed, alone, ctx = packed_against_each_document("cuda", torch.bfloat16, chunk, wrap)
    assert not isinstance(ctx[1], torch.Tensor)  # a BlockMask
    assert alone < 0.1 and packed <= 2 * alone, (packed, alone)


def test_copies_stay_inside_one_registration_of_host_memory(shm_dir):
    """Host memory pinned in pieces (:func:`megatrain_ray.engine.compute.device.pin_in_pieces`): a block inside
    one piece copies to and from the device; the cuts follow the blocks, so no block crosses two
    pieces. A copy that did cross two registrations is what the driver refuses ("invalid argument",
    the crash of a LoRA base past 64 GiB); shown here on a small mapping, so the cause stays on record."""
    from megatrain_ray.engine.store import shm
    from megatrain_ray.engine.compute.device import PAGE, CudaBackend

    blocks = [0, 256 * PAGE, 384 * PAGE]  # bytes: three blocks, the last one 128 pages long
    host = shm.create(os.path.join(shm_dir, "pinned"), 512 * PAGE, torch.uint8)  # /dev/shm, as the store's
    host.copy_(torch.arange(host.numel(), dtype=torch.int64).remainder(251).to(torch.uint8))
    backend = CudaBackend(1, 64 * PAGE, torch.uint8)
    try:
        backend.register_host(host, blocks, piece_bytes=256 * PAGE)
        assert len(backend._registered) == 2
        for a, b in zip(blocks, [*blocks[1:], host.numel()]):
            dev = host[a:b].to("cuda", non_blocking=True)
            back = torch.empty_like(host[a:b])
            back.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()
            assert torch.equal(back, host[a:b])
        crossing = host[255 * PAGE:257 * PAGE]  # one page of each registration
        try:
            torch.empty(crossing.numel(), dtype=torch.uint8, device="cuda").copy_(crossing, non_blocking=True)
            torch.cuda.synchronize()
            refused = ""
        except RuntimeError as e:
            refused = str(e)
        assert "invalid argument" in refused, "the driver copied across two registrations"
    finally:
        backend.close()
        del host
        os.unlink(os.path.join(shm_dir, "pinned"))
