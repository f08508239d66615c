"""A step's GPU work by kind of kernel (megatrain_ray.orchestration.gpu_work): attention through
FlexAttention apart from SDPA's, the routed experts' weights read per micro-batch and pass, each
part priced at its own rate, and the plan's line naming them."""

import re

import pytest

from megatrain_ray.bench import base_sections, bench_config
from megatrain_ray.model.flops import attended
from megatrain_ray.orchestration import gpu_work, pace


def _bench(preset: str, tokens: int, seq_len: int, micro_batches: int, *extra: str, layers: int | None = None):
    return bench_config(base_sections(preset, None, None, layers), tokens, seq_len, micro_batches, 3, None, list(extra))


def _attention_flops(cfg, again: float) -> float:
    """The attention FLOPs of the whole step, however they run: 6 S d per token per layer, 2 S d more
    where the forward runs again (S: the keys each query spans, d: heads x head size)."""
    m, t = cfg.model, cfg.train
    tokens = t.seq_len * t.micro_batch_size * t.num_micro_batches
    return tokens * m.num_attention_heads * m.head_size * attended(m, t.seq_len) * (6 + 2 * again)


def test_attention_runs_through_flex_attention_where_a_layer_takes_a_mask_on_cuda():
    oss = _bench("gpt-oss-20b", 65536, 4096, 16, "lora.rank=16", layers=4)  # sinks: every layer a BlockMask
    w = gpu_work.step_work(oss, 4)
    assert gpu_work.flex_layers(oss) == (0, 1, 2, 3)
    assert w.attention == 0 and w.flex_attention == pytest.approx(_attention_flops(oss, 1.0))
    dense = _bench("7b", 65536, 1024, 4, layers=2)  # causal SDPA, no mask
    w = gpu_work.step_work(dense, 1)
    assert gpu_work.flex_layers(dense) == () and w.flex_attention == 0
    assert w.attention == pytest.approx(_attention_flops(dense, 0.5))
    packed = _bench("7b", 65536, 1024, 4, "data.pack_documents=true", layers=2)  # a document mask each
    w = gpu_work.step_work(packed, 1)
    assert gpu_work.flex_layers(packed) == (0, 1) and w.attention == 0
    assert w.flex_attention == pytest.approx(_attention_flops(packed, 0.5))
    parts = {what: s for what, _, s in gpu_work.work_parts(packed, w, 1.0)}
    assert parts["FlexAttention"] == pytest.approx(w.flex_attention / (gpu_work.FLEX_ATTENTION_TFLOPS * 1e12))
    assert parts["attention"] == 0


def test_the_experts_weights_are_read_once_a_micro_batch_for_each_pass():
    m = _bench("qwen3-30b-a3b", 65536, 1024, 4, "lora.rank=16", layers=2).model
    per_pass = 2 * m.num_experts * 3 * m.hidden_size * m.expert_size * 2  # 2 layers, every expert, bf16
    for recomputed, trained in ((0, False), (2, False), (1, True)):
        cfg = _bench("qwen3-30b-a3b", 65536, 1024, 4, *([] if trained else ["lora.rank=16"]), layers=2)
        w = gpu_work.step_work(cfg, recomputed)
        # forward, input gradients, the recompute up to the down projection (2/3 of the GEMMs) in its
        # share of the layers, and the weight gradients where the experts train
        passes = 2 + recomputed / 2 * 2 / 3 + (gpu_work.EXPERT_TRAINED_PASS if trained else 0)
        assert w.expert_bytes == pytest.approx(4 * per_pass * passes), (recomputed, trained)
    few = _bench("qwen3-30b-a3b", 16, 4, 4, "lora.rank=16", layers=2)  # 4 tokens a micro-batch x top-8: 32 experts
    assert gpu_work.step_work(few, 0).expert_bytes == pytest.approx(4 * per_pass * 2 * 32 / 128)
    assert gpu_work.step_work(_bench("7b", 65536, 1024, 4, layers=2), 0).expert_bytes == 0


def test_each_part_is_priced_at_its_rate_and_wider_experts_run_faster():
    cfg = _bench("qwen3-30b-a3b", 65536, 1024, 4, "lora.rank=16", layers=2)
    w = gpu_work.step_work(cfg, 2)
    parts = {what: (n, s) for what, n, s in gpu_work.work_parts(cfg, w, 0.5)}  # a GPU of half the H200's rate
    width = cfg.model.expert_size
    rate = gpu_work.EXPERT_TFLOPS * width / (width + gpu_work.EXPERT_HALF_WIDTH)
    assert parts["expert GEMMs"] == (w.experts, pytest.approx(w.experts / (rate * 1e12 * 0.5)))
    reads = w.expert_bytes / (gpu_work.EXPERT_WEIGHT_GBPS * 1e9 * 0.5)
    assert parts["expert weights"] == (w.expert_bytes, pytest.approx(reads))
    dense = w.dense / (gpu_work.gemm_tflops(cfg.model.hidden_size) * 1e12 * 0.5)
    assert parts["dense GEMMs"][1] == pytest.approx(dense)
    trained = _bench("qwen3-30b-a3b", 65536, 1024, 4, layers=2)
    assert gpu_work.expert_tflops(trained) > gpu_work.expert_tflops(cfg)  # their own rate, fitted apart
    wide = _bench("qwen3-30b-a3b", 65536, 1024, 4, "lora.rank=16", "model.moe_intermediate_size=2880", layers=2)
    assert gpu_work.expert_tflops(cfg) < gpu_work.expert_tflops(wide) < gpu_work.EXPERT_TFLOPS


def test_the_plan_line_names_flex_attention_and_the_experts_weights_in_bytes():
    cfg = _bench("gpt-oss-20b", 65536, 4096, 16, "lora.rank=16", "lora.base_format=mxfp4")
    p = pace.expected_pace(cfg, "cuda", cfg.model.num_hidden_layers, gpu_name="NVIDIA H200")
    line = p.line()
    assert re.search(r"FlexAttention [\d.]+ m?s \([\d.]+ TFLOP\)", line), line
    assert re.search(r"expert weights [\d.]+ m?s \([\d,]+ GB\)", line), line
    assert re.search(r"dequantization [\d.]+ m?s \([\d.]+ G parameters\)", line), line
    assert ", attention " not in line  # no SDPA attention in this model
