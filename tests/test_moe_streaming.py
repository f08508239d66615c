"""A sparse layer on the link: its parts' ranges, and what crosses in a real run.

- The layout: a sparse layer's parts (attention with router and norms, shared expert, each routed
  expert) tile its block, every expert's part is its gate, up and down weights, and the merged
  ranges of all parts are the whole block (one copy, as a dense unit); of consecutive experts, two.
- A real run (Ray actors, shared memory, the CPU in fp32) of a tiny Qwen2-MoE with 16 experts and
  few tokens, so that some expert of some layer receives no token in a step: per step, layer and
  expert, the engine's counts say an expert without a token was fetched once (for the forward) and
  sent no gradient bytes, one with tokens fetched again for the backward and sent its whole
  gradient (both counted from the ranges handed to the copies); and the bytes the compute worker's
  gradient copies moved to the host (its timeline's d2h bytes, counted from the tensors copied) are
  exactly every unit's gradient less the idle experts'. (The training parity of the same path,
  idle experts included, is tests/test_moe_training.py.)
- A sparse layer kept whole (its graph, engine.compute.passes.KeptSparse): the planner's bytes per token
  bound what autograd saves, and a run with every layer kept trains bit for bit as one with every
  layer recomputed.
"""

import dataclasses
import json

import pytest
import torch

pytest.importorskip("transformers")

from artifacts import make_model, parity_run, read_tensors  # noqa: E402
from saved_bytes import layer_inputs, saved_bytes  # noqa: E402

from megatrain_ray.engine.compute.activations import sparse_kept_bytes_per_token  # noqa: E402
from megatrain_ray.io.hf_io import load_train_config  # noqa: E402
from megatrain_ray.model import transformer as M  # noqa: E402
from megatrain_ray.model.layout import StoreLayout  # noqa: E402
from megatrain_ray.model.presets import preset_model  # noqa: E402
from megatrain_ray.orchestration.device_memory import activation_placement  # noqa: E402
from megatrain_ray.model.moe import ATTENTION, EXPERT, SHARED_EXPERT  # noqa: E402
from megatrain_ray.orchestration.pipeline import train  # noqa: E402


def _config(tmp_path, shm_dir, steps=2):
    make_model("qwen2_moe", num_experts=16).save_pretrained(tmp_path / "init")
    return load_train_config(None, [*parity_run(tmp_path, shm_dir, steps), "train.seq_len=8",
                                    "train.micro_batch_size=1", "train.num_micro_batches=2"])


def test_sparse_layer_parts_tile_its_block(tmp_path, shm_dir):
    cfg = _config(tmp_path, shm_dir).model
    layout = StoreLayout.build(cfg)
    sparse = [u for u in layout.layers if u.parts]
    assert [u.layer for u in sparse] == list(cfg.sparse_layers) and not any(
        u.parts for u in layout.layers if u.layer not in cfg.sparse_layers)
    h, i = cfg.hidden_size, cfg.expert_size
    for unit in sparse:
        numel = layout.templates[unit.index].numel
        covered = sorted(r for p in unit.parts for r in p.ranges)
        assert covered[0][0] == 0 and covered[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # no gap, no overlap
        assert [p.kind for p in unit.parts] == [ATTENTION, SHARED_EXPERT] + [EXPERT] * cfg.num_experts
        assert [p.expert for p in unit.experts] == list(range(cfg.num_experts))
        assert all(p.numel == 3 * i * h and len(p.ranges) == 2 for p in unit.experts)  # gate + up, then down
        assert unit.ranges(unit.parts) == [(0, numel)]
        assert len(unit.ranges(unit.experts[3:7])) == 2
        assert len(unit.ranges([unit.experts[3], unit.experts[5]])) == 4


def test_idle_experts_send_no_gradient_and_are_not_fetched_again(ray_cluster, shm_dir, tmp_path):
    cfg = _config(tmp_path, shm_dir)
    result = train(cfg, log=lambda line: None)
    rows = [json.loads(line) for line in open(tmp_path / "runs" / result.run_id / "metrics.jsonl")]
    layout = StoreLayout.build(cfg.model)
    sparse = [u for u in layout.layers if u.parts]
    numel = {u.index: layout.templates[u.index].numel for u in layout.records}
    fp32 = 4
    idle_seen = 0
    for row in rows:
        assert len(row["expert_tokens"]) == len(row["expert_refetches"]) == len(row["expert_grad_bytes"]) == len(sparse)
        idle = 0  # elements of the experts without a token in this step
        for unit, tokens, refetches, sent in zip(sparse, row["expert_tokens"], row["expert_refetches"],
                                                  row["expert_grad_bytes"]):
            for part, n, fetched, nbytes in zip(unit.experts, tokens, refetches, sent):
                assert (fetched, nbytes) == ((1, part.numel * fp32) if n else (0, 0)), (row["step"], unit.name, part.name)
                idle += 0 if n else part.numel
        idle_seen += idle > 0
        assert row["d2h_bytes"] == fp32 * (sum(numel.values()) - idle)  # every gradient once, less the idle experts'
    assert idle_seen, "no expert went without a token: the test does not exercise it"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [{}, {"shared_expert_intermediate_size": 96}, {"num_experts_per_tok": 4}])
def test_sparse_kept_graph_bytes_bound_what_autograd_saves(shape, dtype):
    """The planner's bytes per token of a sparse layer kept whole against what routed_layer's autograd
    saves (tests/saved_bytes.py: counted as test_actplace counts a dense layer's), eagerly on the CPU:
    never less, at most 8% more (the normed input counted once more than it is held)."""
    cfg = dataclasses.replace(preset_model("small-moe", 1), **shape)
    b, s = 2, 64
    leaves, x, rope = layer_inputs(cfg, dtype, b, s)
    held = saved_bytes(lambda *args: M.routed_layer(*args)[0], leaves, x, rope, cfg) / (b * s)
    assert held <= sparse_kept_bytes_per_token(cfg, dtype.itemsize) <= 1.08 * held


PLACEMENTS = {"keep": ((), ("keep",) * 3), "recompute": ((), ("gpu",) * 3),
              "counts": (("memory.spanned_layers=2",), ("gpu", "span", "span"))}


def test_sparse_layers_train_alike_kept_recomputed_or_in_a_span(ray_cluster, shm_dir, tmp_path):
    """Every layer of a Qwen3-MoE (dense and sparse, the load-balancing loss on) kept whole, every
    layer recomputed, and every layer but the first in a recompute span (a sparse layer's forward
    run again from weights fetched after the routing, without its idle experts): the same function
    on the same values, so the same losses and final weights bit for bit, idle experts included."""
    make_model("qwen3_moe", num_experts=16, output_router_logits=True, router_aux_loss_coef=0.05).save_pretrained(
        tmp_path / "init")
    results = {}
    for placement, (extra, modes) in PLACEMENTS.items():
        cfg = load_train_config(None, [*parity_run(tmp_path, shm_dir, 2), "train.seq_len=8", "train.micro_batch_size=1",
                                       "train.num_micro_batches=2", f"memory.activations={placement}",
                                       *extra, f"train.run_dir={tmp_path / placement}"])
        assert cfg.model.output_router_logits and cfg.model.sparse_layers == (0, 2)
        assert activation_placement(cfg, "cpu", None) == modes
        result = train(cfg, log=lambda line: None)
        rows = [json.loads(line) for line in open(tmp_path / placement / result.run_id / "metrics.jsonl")]
        results[placement] = (result.losses, [r["expert_tokens"] for r in rows], [r["expert_refetches"] for r in rows],
                              read_tensors(tmp_path / placement / result.run_id / "final"))
    losses, routed, refetches, weights = results["recompute"]
    assert any(n == 0 for step in routed for layer in step for n in layer)
    assert [[[n > 0 for n in layer] for layer in step] for step in routed] == refetches
    assert results["keep"][2] == refetches  # a kept layer's weights still come for its backward, routed
    # in the span: sparse layer 0 is fetched again for the span's forward and for its backward, layer 2 once
    assert results["counts"][2] == [[[2 * n for n in step[0]], step[1]] for step in refetches]
    for placement in ("keep", "counts"):
        got_losses, got_routed, _, got = results[placement]
        assert got_losses == losses and got_routed == routed, placement
        assert set(got) == set(weights) and all(torch.equal(got[k], weights[k]) for k in weights), placement
