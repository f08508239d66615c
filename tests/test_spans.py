"""Recompute spans (megatrain_ray.engine.compute.activations.SPAN): layers without a checkpoint of their own,
whose inputs the backward brings back by running the span's forward again from the checkpoint
before them.

The claim is exact: the span's forward is the same function on the same values as the first
forward, so its inputs, and hence every gradient, are bit for bit those of per-layer checkpoints
(fp32 on the CPU, where every kernel is deterministic); tests compare with ``torch.equal``, never
within a tolerance. What changes is the work: one more layer forward per span layer but the
last, and their weights streamed once more, counted here exactly.
"""

import re

import numpy as np
import pytest
import torch

from megatrain_ray import cli
from megatrain_ray.config import load_config
from megatrain_ray.engine.compute.activations import GPU, HOST, KEEP, SPAN, layer_modes, recompute_spans, recomputed_layers
from megatrain_ray.engine.schedule import Schedule
from megatrain_ray.model import flops
from megatrain_ray.model.layout import StoreLayout
from megatrain_ray.orchestration import preflight

from test_actplace import _config, _cpu_step  # noqa: E402  (the compute worker's step on the CPU, real store)

GiB = 2**30



def _placement(setting: str) -> list[str]:
    """``recompute`` or counts written ``"keep=K,host=H,span=P"`` (for short test ids) as memory overrides."""
    if setting == "recompute":
        return ["memory.activations=recompute"]
    names = {"keep": "kept_layers", "host": "offloaded_layers", "span": "spanned_layers"}
    return ["memory.activations=counts", *(f"memory.{names[k]}={v}" for k, v in
                                           (part.split("=") for part in setting.split(",")))]

def test_placements_lay_spans_out_evenly_after_a_checkpoint():
    assert layer_modes(3, 0, 0, 1) == (GPU, SPAN, GPU)
    assert layer_modes(3, 0, 0, 2) == (GPU, SPAN, SPAN)
    assert layer_modes(3, 0, 1, 1) == (HOST, SPAN, GPU)
    assert layer_modes(3, 1, 0, 1) == (GPU, SPAN, KEEP)
    assert layer_modes(7, 0, 2, 4) == (HOST, SPAN, SPAN, HOST, SPAN, GPU, SPAN)
    assert layer_modes(4, 1, 1) == (HOST, GPU, GPU, KEEP)  # without spans: as before
    assert recompute_spans(layer_modes(7, 0, 2, 4)) == ((0, 2), (3, 4), (5, 6))
    assert recompute_spans((GPU, SPAN, KEEP)) == ((0, 1),) and recompute_spans((GPU, HOST, KEEP)) == ()
    assert recomputed_layers(layer_modes(7, 0, 2, 4)) == (7, 4)  # 7 recomputes, 4 layer forwards run again
    for bad in ((3, 0, 0, 3), (3, 1, 0, 2), (3, 0, 2, 2)):
        with pytest.raises(ValueError):
            layer_modes(*bad)


def test_the_schedule_fetches_a_span_s_layers_again_before_its_backward():
    cfg = load_config(None, ["model.num_hidden_layers=4"])
    layout = StoreLayout.build(cfg.model)
    plain = Schedule.build(layout, tied=False).fetch
    assert plain == (0, 1, 2, 3, 4, 5, 4, 3, 2, 1)
    # span (0, 2): layers 0-2 (units 1-3); before layer 2's backward, layers 0 and 1 forward again
    assert Schedule.build(layout, tied=False, spans=((0, 2),)).fetch == (0, 1, 2, 3, 4, 5, 4, 1, 2, 3, 2, 1)
    assert Schedule.build(layout, tied=False, spans=((0, 1), (2, 3))).fetch == (0, 1, 2, 3, 4, 5, 3, 4, 3, 1, 2, 1)


@pytest.mark.parametrize("placement", [(GPU, SPAN, GPU), (GPU, SPAN, SPAN), (HOST, SPAN, GPU), (GPU, SPAN, KEEP),
                                       (HOST, SPAN, SPAN)])
def test_spans_give_per_layer_checkpoints_losses_and_gradients_bit_for_bit(placement, tmp_path, shm_dir):
    cfg = _config(tmp_path, shm_dir)
    ref_calls, calls = [], []
    ref, ref_grads = _cpu_step(cfg, shm_dir, (GPU,) * 3, calls=ref_calls)
    got, grads = _cpu_step(cfg, shm_dir, placement, calls=calls)
    assert got["loss"] == ref["loss"]
    assert grads.keys() == ref_grads.keys()
    for unit, named in grads.items():
        for key, g in named.items():
            assert torch.equal(g, ref_grads[unit][key]), f"unit {unit} {key}"
    recomputed, again = recomputed_layers(placement)
    micro_batches = cfg.train.num_micro_batches
    assert len(calls) == micro_batches * (3 + recomputed + again)  # the forwards, the recomputes, the spans' forwards
    assert again == sum(b - a for a, b in recompute_spans(placement)) > 0
    assert got["fetches"]["layers"] == ref["fetches"]["layers"] + again == 2 * 3 + again
    moved = sum(n for lane, label, _, _, n in got["intervals"] if lane == "d2h" and "inputs" in label)
    assert moved == placement.count(HOST) * micro_batches * 2 * 32 * 64 * 4  # only the offloaded checkpoints go out


def _packed_corpus(path) -> str:
    """Pre-tokenized documents of 5-70 tokens (an Arrow file, as data.format=tokens reads it)."""
    import pyarrow as pa

    rng = np.random.default_rng(0)
    docs = [(int(rng.integers(0, 95)) + np.arange(int(rng.integers(5, 70)))) % 95 + 1 for _ in range(80)]
    table = pa.table({"input_ids": [d.tolist() for d in docs]})
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)
    return str(path)


def test_packed_documents_with_a_tiled_mlp_train_through_spans_as_through_checkpoints(tmp_path, shm_dir):
    """The single-process driver over packed documents (masked attention, per-document positions)
    with the MLP in chunks: per-layer checkpoints, spans, and spans starting from offloaded
    checkpoints train the same run bit for bit (every step's loss and gradient norm)."""
    from megatrain_ray.orchestration.local import train_local

    corpus = _packed_corpus(tmp_path / "docs.arrow")
    common = ["model.hidden_size=64", "model.intermediate_size=176", "model.num_hidden_layers=5",
              "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=96",
              f"data.path={corpus}", "data.format=tokens", "data.pack_documents=true", "train.seq_len=96",
              "train.micro_batch_size=2", "train.num_micro_batches=2", "train.steps=3", "optim.lr=1e-2",
              "compute.device=cpu", "memory.mlp_chunk_size=40", "memory.loss_chunk_size=50",
              f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path / 'runs'}", "train.save_final=false",
              "train.checkpoint_every=0"]
    runs = {}
    for setting in ("recompute", "span=3", "host=2", "host=2,span=2", "keep=1", "keep=1,span=2"):
        rows = train_local(load_config(None, [*common, *_placement(setting)]), 0)
        runs[setting] = [(r["loss"], r["grad_norm"]) for r in rows]
    assert runs["recompute"][-1][0] < runs["recompute"][0][0]  # it trains
    # each against the same placement with a checkpoint per layer (a kept layer runs its MLP untiled)
    for spans, checkpoints in (("span=3", "recompute"), ("host=2,span=2", "host=2"), ("keep=1,span=2", "keep=1")):
        assert runs[spans] == runs[checkpoints], spans
    assert runs["host=2"] == runs["recompute"]


def test_a_mixture_of_experts_trains_through_spans_as_through_checkpoints(tmp_path, shm_dir):
    """Sparse layers in spans: their forward runs again routed as before (the router's statistics
    stay the first forward's), the same run bit for bit."""
    from megatrain_ray.orchestration.local import train_local

    common = ["model.model_type=qwen3_moe", "model.hidden_size=32", "model.intermediate_size=64",
              "model.num_hidden_layers=3", "model.num_attention_heads=4", "model.num_key_value_heads=2",
              "model.num_experts=4", "model.num_experts_per_tok=2", "model.moe_intermediate_size=16",
              "train.seq_len=32", "train.micro_batch_size=2", "train.num_micro_batches=2", "train.steps=2",
              "compute.device=cpu", f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path / 'runs'}",
              "train.save_final=false", "train.checkpoint_every=0"]
    runs = {setting: [(r["loss"], r["grad_norm"], r.get("aux_loss")) for r in
                      train_local(load_config(None, [*common, *_placement(setting)]), 0)]
            for setting in ("recompute", "span=2")}
    assert runs["span=2"] == runs["recompute"]


def test_the_recompute_of_a_sparse_layer_sends_each_token_to_the_experts_its_forward_chose(tmp_path, shm_dir,
                                                                                           monkeypatch):
    """The backward's recompute and a span's forward again are given the forward's choice of experts
    rather than choosing again: a router whose choice in those runs were different (here: any choice
    made with gradients on is the bottom k, as a compiled training graph whose last bits differ from
    the no-grad one's may flip a near tie) changes nothing, bit for bit; the router chooses only in
    each layer's first forward (3 sparse layers x 2 micro-batches x 2 steps)."""
    from megatrain_ray.model import moe
    from megatrain_ray.orchestration.local import train_local

    common = ["model.model_type=qwen3_moe", "model.hidden_size=32", "model.intermediate_size=64",
              "model.num_hidden_layers=3", "model.num_attention_heads=4", "model.num_key_value_heads=2",
              "model.num_experts=4", "model.num_experts_per_tok=2", "model.moe_intermediate_size=16",
              "train.seq_len=32", "train.micro_batch_size=2", "train.num_micro_batches=2", "train.steps=2",
              "compute.device=cpu", f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path / 'runs'}",
              "train.save_final=false", "train.checkpoint_every=0", *_placement("span=2")]

    def run():
        return [(r["loss"], r["grad_norm"], r.get("aux_loss")) for r in train_local(load_config(None, common), 0)]

    plain = run()
    route, chose = moe.route, []

    def contrary(p, x, cfg, chosen=None):
        chose.append(chosen is None)
        if chosen is None and torch.is_grad_enabled():
            probs = torch.softmax(torch.nn.functional.linear(x, p[moe.names(cfg).router]), -1, dtype=torch.float32)
            chosen = torch.topk(probs, cfg.num_experts_per_tok, dim=-1, largest=False).indices
        return route(p, x, cfg, chosen)

    monkeypatch.setattr(moe, "route", contrary)
    assert run() == plain
    assert chose.count(True) == 3 * 2 * 2 and len(chose) > 12, chose


H200_BOX = ["--device", "cuda", "--gpu-memory", "141", "--host-memory", "120"]
FULL_7B = ["model.model_type=qwen2", "model.vocab_size=152064", "model.hidden_size=3584",
           "model.intermediate_size=18944", "model.num_hidden_layers=28", "model.num_attention_heads=28",
           "model.num_key_value_heads=4", "train.micro_batch_size=1", "train.num_micro_batches=1",
           "optim.state=8bit", "memory.mlp_chunk_size=16384", "data.num_workers=1"]


def _plan(capsys, tokens: int, *args) -> str:
    sets = [*FULL_7B, f"train.seq_len={tokens}", f"model.max_position_embeddings={tokens}"]
    capsys.readouterr()
    cli.main(["plan", *H200_BOX, *args, *sum((["--set", s] for s in sets), [])])
    return capsys.readouterr().out


def test_plan_spans_the_full_7b_at_768k_tokens_onto_the_h200_box_and_prices_it(capsys):
    tokens = 786_432  # the longest length a multiple of 256k whose checkpoints host RAM cannot all take
    out = _plan(capsys, tokens)
    gpu = re.search(r"^total GPU\s+([\d.]+) GiB  \(usable ([\d.]+) GiB: ok\)$", out, re.M)
    host = re.search(r"^total host RAM\s+([\d.]+) GiB  \(available 120.0 GiB: ok\)$", out, re.M)
    assert gpu and host, out
    line = re.search(r"^activations \(chosen by the planner .*\): 0 layers kept whole on the GPU .*, (\d+) checkpointed "
                     r"on the GPU .*, (\d+) offloaded to host RAM .*; (\d+) more have no checkpoint of their own, neither "
                     r"the GPU nor host RAM holding every layer's: (\d+) recompute spans of up to (\d+) layers rerun "
                     r"(\d+) layer forwards in the backward \(\+([\d.,]+) PFLOP, \+(\d+)% of the step's\)$", out, re.M)
    assert line, out
    on_gpu, off, span, spans, longest, again = (int(g) for g in line.groups()[:6])
    assert on_gpu + off + span == 28 and span > 0 and spans == on_gpu + off and again == span
    cfg = load_config(None, [*FULL_7B, f"train.seq_len={tokens}", f"model.max_position_embeddings={tokens}"])
    extra = flops.recompute_flops(cfg.model, tokens, tokens, 0, again)
    assert float(line.group(7).replace(",", "")) == pytest.approx(extra / 1e15, abs=0.05)
    assert re.search(rf"^recompute spans: {span} layers without a checkpoint, a span's inputs during its backward "
                     rf"\({longest - 1} x 1 x {tokens} tokens x 3584\)\s+GPU", out, re.M), out
    step = re.search(r"^expected step time: ~(\d+) min \(", out, re.M)
    assert step and 15 < int(step.group(1)) < 35, out  # ~2.5x the 512k step: attention grows with the square


def test_the_full_7b_at_a_million_tokens_does_not_fit_the_h200_and_the_plan_says_so(capsys):
    """The working set of one layer's backward at 1,048,576 tokens (83.5 GiB: the attention kernel's
    scratch alone 28.1) leaves the GPU too little for the checkpoints in flight, with or without spans."""
    out = _plan(capsys, 1_048_576)
    assert re.search(r"^total GPU .*: DOES NOT FIT\)$", out, re.M), out
    longest = re.search(r"^longest context that fits: ([\d,]+) tokens per sequence", out, re.M)
    assert longest and 786_432 <= int(longest.group(1).replace(",", "")) < 1_048_576, out


def test_spans_are_chosen_only_where_memory_requires(capsys):
    out = _plan(capsys, 524_288)  # the 512k run fits the GPU and the host without them
    assert "recompute spans" not in out and re.search(r"^total GPU .*: ok\)$", out, re.M), out
    cfg = load_config(None, [*FULL_7B, "train.seq_len=1048576", "model.max_position_embeddings=1048576"])
    modes = preflight.activation_placement(cfg, "cuda", 141 * GiB)  # host RAM not limited: offload, no spans
    assert SPAN not in modes and HOST in modes
    half = load_config(None, [*FULL_7B, "train.seq_len=524288", "model.max_position_embeddings=524288"])
    modes = preflight.activation_placement(half, "cuda", 141 * GiB, host_bytes=0)  # no host RAM: spans on the GPU
    assert SPAN in modes and HOST not in modes and modes[0] == GPU
    assert SPAN not in preflight.activation_placement(half, "cuda", 141 * GiB)  # with it: offloaded instead
    assert preflight.activation_placement(cfg, "cuda", 10_000 * GiB, host_bytes=0) == (KEEP,) * 28
