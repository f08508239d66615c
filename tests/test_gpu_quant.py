"""A quantized base (lora.base_format) on a CUDA GPU: the dequantization there is the CPU's bit for bit, and a
LoRA run over an nf4 base (a dense model) and over an mxfp4 base (a mixture of experts) trains through the
real pipeline, its layers crossing the link as their quantized bytes.

The CPU path is bitsandbytes' bit for bit for nf4 and int8 (tests/test_quant.py, tests/test_quant_store.py),
transformers' for mxfp4 (tests/test_quant_mxfp4.py); the GPU runs the same torch ops (an index lookup,
fp32 multiplies and adds, one rounding to the output dtype, each exact in IEEE arithmetic whatever the
device), which this checks on every record kind of a dense and a sparse layer (mxfp4: of the sparse one,
and its quantizer too). One layer's dequantization time against its copy over the link is
benchmarks/dequant_rate.py's. Skipped without CUDA.
"""

import numpy as np
import pytest
import torch

from megatrain_ray.config.model import ModelConfig
from megatrain_ray.engine.store.quantized import DeviceDequant, QuantizedBase
from megatrain_ray.model.layout import StoreLayout
from megatrain_ray.model.presets import preset_model
from megatrain_ray.model.quant_layout import QuantLayout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _base(cfg: ModelConfig, fmt: str, dtype: torch.dtype, units=None) -> QuantizedBase:
    layout = QuantLayout.build(cfg, fmt, dtype)
    base = QuantizedBase(cfg, fmt, dtype, torch.zeros(layout.total, dtype=torch.uint8))
    g = torch.Generator().manual_seed(0)
    for i, t in enumerate(base.templates):
        if units is None or i in units:
            for name, shape, _ in t.params:
                base.write(i, name, torch.randn(shape, generator=g) * 0.02)
    return base


def _dequant(base: QuantizedBase, device: str, dtype: torch.dtype, units) -> DeviceDequant:
    slots = [torch.zeros(base.layout.largest(units), dtype=torch.uint8, device=device)]
    return DeviceDequant(base.layout, base.templates, slots, dtype)


@pytest.mark.parametrize("preset", ["small", "small-moe"])
@pytest.mark.parametrize("fmt,dtype", [("nf4", torch.bfloat16), ("nf4", torch.float32), ("int8", torch.bfloat16),
                                       ("mxfp4", torch.bfloat16), ("mxfp4", torch.float32)],
                         ids=["nf4-bf16", "nf4-fp32", "int8-bf16", "mxfp4-bf16", "mxfp4-fp32"])
def test_gpu_dequantization_is_the_cpus_bit_for_bit(preset, fmt, dtype):
    cfg = preset_model(preset, 2)
    if fmt == "mxfp4" and not cfg.sparse_layers:
        pytest.skip("mxfp4 quantizes a mixture of experts' routed experts; a dense model has none")
    base, layout = _base(cfg, fmt, dtype), StoreLayout.build(cfg)
    units = range(len(layout.units))
    cpu, gpu = _dequant(base, "cpu", dtype, units), _dequant(base, "cuda", dtype, units)
    for unit in layout.records:
        block = base.block(unit.index)
        cpu.byte_slots[0][:block.numel()].copy_(block)
        gpu.byte_slots[0][:block.numel()].copy_(block)
        ranges = unit.ranges(unit.parts[:1] + unit.experts[::2]) if unit.parts else None
        for r in (None, ranges):
            want = cpu.weights(0, unit.index, r).clone()
            got = gpu.weights(0, unit.index, r).cpu()
            assert torch.equal(want.view(torch.uint8), got.view(torch.uint8)), (unit.name, r)


def test_gpu_mxfp4_quantizer_is_the_cpus_bit_for_bit():
    from megatrain_ray.model.mxfp4 import quantize_mxfp4

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(512, 1024, generator=g) * torch.logspace(-20, 20, 512)[:, None]).to(dtype)
        w[:4, :64] = 0.0
        cpu, gpu = quantize_mxfp4(w), quantize_mxfp4(w.cuda())
        assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu)), dtype


def _lora_over_bf16_and(quantized: str, model, tmp_path, shm_dir, *extra: str):
    """``model`` (transformers') trained with LoRA on cuda over the bf16 base and over a ``quantized`` one
    (lora.base_format), 12 steps each: the loss falls in both (~1.0 on the CPU in fp32) and ends near
    the bf16 base's. Returns ({format: layers.0's bytes over the link}, the run's config)."""
    from megatrain_ray.io.hf_io import load_train_config
    from megatrain_ray.orchestration.pipeline import train

    model.save_pretrained(tmp_path / "init", safe_serialization=True)
    rng = np.random.default_rng(1)
    tokens = np.where(rng.random(20000) < 0.1, rng.integers(0, 96, size=20000), (np.arange(20000) * 7) % 96)
    np.save(tmp_path / "tokens.npy", tokens)
    losses, h2d = {}, {}
    for fmt in ("compute", quantized):
        cfg = load_train_config(None, [
            f"train.init_from={tmp_path / 'init'}", f"data.path={tmp_path / 'tokens.npy'}",
            f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path / fmt}", "compute.device=cuda",
            "train.steps=12", "train.seq_len=64", "train.micro_batch_size=4", "train.num_micro_batches=2",
            "train.checkpoint_every=0", "optim.lr=1e-2", "optim.warmup_steps=2",
            "lora.rank=8", "lora.alpha=16", *extra, f"lora.base_format={fmt}",
        ])
        result = train(cfg, log=lambda line: None)
        losses[fmt] = result.losses
        h2d[fmt] = max(n for lane, label, _, _, n in result.timeline if lane == "h2d" and label == "layers.0")
    for fmt, ls in losses.items():
        print(f"losses, {fmt} base:", " ".join(f"{x:.3f}" for x in ls))
    print(f"layers.0 over the link: bf16 {h2d['compute']} bytes, {quantized} {h2d[quantized]} bytes")
    for fmt, ls in losses.items():
        assert all(np.isfinite(ls)) and ls[-1] < ls[0] - 0.3, fmt
    assert abs(losses[quantized][-1] - losses["compute"][-1]) < 0.1 * losses["compute"][0]
    return h2d, cfg


def test_lora_over_an_nf4_base_trains_on_cuda(ray_cluster, shm_dir, tmp_path):
    """A tiny Llama (hidden 256) trained with LoRA over an nf4 base on the GPU: the loss falls as the same run's
    over the bf16 base does (and near it), and each layer crosses the link as its nf4 bytes."""
    from artifacts import make_model

    model = make_model("llama2", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4)
    h2d, _ = _lora_over_bf16_and("nf4", model, tmp_path, shm_dir)
    assert h2d["nf4"] < 0.3 * h2d["compute"]


def test_lora_over_an_mxfp4_base_trains_on_cuda(ray_cluster, shm_dir, tmp_path):
    """A tiny Qwen3-MoE (hidden 256, 8 experts of width 128) trained with LoRA on its attention and experts
    over an mxfp4 base on the GPU: the loss falls as the same run's over the bf16 base does (and near it),
    and each sparse layer crosses the link as its bytes with the experts in MXFP4."""
    from artifacts import make_model

    model = make_model("qwen3_moe", hidden_size=256, moe_intermediate_size=128, num_experts=8, num_attention_heads=4,
                       num_key_value_heads=4, head_dim=64, mlp_only_layers=[])
    h2d, cfg = _lora_over_bf16_and("mxfp4", model, tmp_path, shm_dir, "lora.target_modules=q_proj,k_proj,v_proj,o_proj")
    layer = StoreLayout.build(cfg.model).templates[1]
    experts = sum(np.prod(s) for n, s, _ in layer.params if ".experts." in n)
    assert h2d["mxfp4"] < h2d["compute"] - 0.99 * experts * (2 - 4.25 / 8)  # the experts at 4.25 bits, not 16 (padding aside)
