"""The planner's working set of a tiled layer's backward (the long-context path) against what the
code allocates.

On the CPU every tensor the recompute-backward of one layer allocates is recorded
(tests/allocations.py) and the largest live set compared with
:func:`~megatrain_ray.engine.compute.sequence.tiled_backward_bytes`, which the plan's "one layer's working
set" row is made of: the figure must cover the recorded peak but for the layer's compute-dtype
weight gradients, which the row adds on top of it (``numel x itemsize``), and must not exceed it.
The shapes are chosen so that each eager moment is the peak once (an MLP chunk's backward, the
input norm's). What no op returns, the attention kernel's scratch on CUDA, is checked against the
one allocation the H200 asked for when a 1,048,576-token backward at the Qwen2.5-7B width ran out
of memory without it (benchmarks/results/2026-12-01_h200_long-context-512k/log_1m-oom.txt).
"""

import pytest
import torch

from allocations import AllocationRecorder
from megatrain_ray.config import load_config
from megatrain_ray.engine.compute.attention import sdpa_backend
from megatrain_ray.engine.compute.sequence import LayerRunner, tiled_backward_bytes
from megatrain_ray.model import transformer as M
from megatrain_ray.model.layout import LayerTemplate
from megatrain_ray.orchestration import preflight

GiB = 2**30
WIDE_MLP = ["model.hidden_size=224", "model.intermediate_size=1184", "model.num_attention_heads=7",
            "model.num_key_value_heads=1", "model.head_dim=32"]
NARROW_MLP = ["model.hidden_size=256", "model.intermediate_size=704", "model.num_attention_heads=8",
              "model.num_key_value_heads=2", "model.head_dim=32"]
SEVEN_B_4L_1M = ["model.model_type=qwen2", "model.vocab_size=152064", "model.hidden_size=3584",
                 "model.intermediate_size=18944", "model.num_hidden_layers=4", "model.num_attention_heads=28",
                 "model.num_key_value_heads=4", "train.seq_len=1048576", "model.max_position_embeddings=1048576",
                 "train.micro_batch_size=1", "train.num_micro_batches=1", "memory.mlp_chunk_size=16384"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape, chunk", [(WIDE_MLP, 512), (NARROW_MLP, 128)])
def test_the_tiled_backward_allocates_what_the_planner_counts(dtype, shape, chunk):
    cfg = load_config(None, ["model.num_hidden_layers=1", "model.vocab_size=512", *shape]).model
    t = LayerTemplate.build(cfg, "layers.0")
    torch.manual_seed(0)
    s = 1024
    flat = (torch.randn(t.numel) * 0.02).to(dtype)
    x, dy = (torch.randn(1, s, cfg.hidden_size, dtype=dtype) for _ in range(2))
    rope = M.rope_cache(cfg, s, torch.device("cpu"), dtype)
    grad = torch.zeros(t.numel)
    grads = t.bind(grad, fused=True)
    leaves = {n: w.detach().requires_grad_(True) for n, w in t.bind(flat, fused=True).items()}
    with sdpa_backend("flash"), AllocationRecorder() as rec:  # the CPU's flash kernel: no [S, S] scores
        LayerRunner(chunk).backward(leaves, grads, x, dy, (rope, None), cfg)
    counted = tiled_backward_bytes(cfg, s, chunk, dtype.itemsize, False, "cpu")
    assert counted <= rec.peak <= counted + t.numel * dtype.itemsize, (counted, rec.peak, rec.report(s))


def test_the_planner_s_row_is_that_figure_with_the_layer_s_gradients():
    cfg = load_config(None, SEVEN_B_4L_1M)
    row = next(r for r in preflight.device_rows(cfg, "cuda", 1, 141 * GiB) if "working set" in r.component)
    numel = LayerTemplate.build(cfg.model, "layers.0").numel
    assert row.nbytes == tiled_backward_bytes(cfg.model, 2**20, 16384, 2, True, "cuda") + numel * (4 + 2)
    assert row.phase == "layer"


def test_the_attention_scratch_is_the_allocation_the_1m_run_lacked_and_the_plan_now_fits_it():
    cfg = load_config(None, SEVEN_B_4L_1M)
    m, tokens = cfg.model, 2**20
    scratch = (tiled_backward_bytes(m, tokens, 16384, 2, True, "cuda")
               - tiled_backward_bytes(m, tokens, 16384, 2, True, "cpu"))
    assert f"{scratch / GiB:.2f}" == "28.11"  # torch's message: "Tried to allocate 28.11 GiB"
    # the placement the run had (every checkpoint on the GPU, the embedding, the head and layer 0 resident) needs
    # more than the 113.46 GiB it held when it asked for those 28.11 (and the GPU's 139.80 GiB)
    ran = load_config(None, [*SEVEN_B_4L_1M, "memory.activations=recompute", "memory.resident=embed_head",
                             "memory.resident_layers=1"])
    rows = preflight.device_rows(ran, "cuda", 1, int(139.3 * GiB), preflight.resident_units(ran.model, 1))
    assert preflight.device_total(rows) > (113.46 + 28.11) * GiB
    # planned by itself, it offloads the checkpoints and keeps no unit resident, and fits
    modes = preflight.activation_placement(cfg, "cuda", int(139.3 * GiB))
    assert modes == ("host",) * 4
    assert preflight.resolve_resident(cfg, "cuda", int(139.3 * GiB)) is None
    rows = preflight.device_rows(cfg, "cuda", 1, int(139.3 * GiB), ())
    assert preflight.device_total(rows) <= preflight.GPU_USABLE * 139.3 * GiB

