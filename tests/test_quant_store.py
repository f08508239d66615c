"""A quantized base's bytes (model.quant_layout, engine.store.quantized) on the CPU: layout, routed fetches, batched dequantization.

Each unit's records follow its template, so a sparse layer's parts (its attention, shared expert and
each routed expert) are byte ranges of the quantized unit: fetching only some experts' bytes and
dequantizing them gives those experts' weights exactly as the whole unit's dequantization does,
while the other experts' places keep what was there. The dequantization of a run of experts in one
set of kernels is each record's on its own (itself bitsandbytes', tests/test_quant.py).
"""

import pytest
import torch

from artifacts import make_model
from megatrain_ray.config.model import ModelConfig
from megatrain_ray.engine.store.quantized import DeviceDequant, QuantizedBase, dequantize, runs
from megatrain_ray.model.layout import StoreLayout
from megatrain_ray.model.quant_layout import NF4, RAW, QuantLayout, bytes_per_param, quantized


def _config(arch: str, **kw) -> ModelConfig:
    return ModelConfig.from_hf_dict(make_model(arch, **kw).config.to_dict())


def _base(cfg: ModelConfig, fmt: str, dtype: torch.dtype) -> QuantizedBase:
    """A quantized base in ordinary memory holding random weights (raw ones too)."""
    layout = QuantLayout.build(cfg, fmt, dtype)
    base = QuantizedBase(cfg, fmt, dtype, torch.zeros(layout.total, dtype=torch.uint8))
    g = torch.Generator().manual_seed(0)
    for i, t in enumerate(base.templates):
        for name, shape, _ in t.params:
            base.write(i, name, torch.randn(shape, generator=g) * 0.05)
    return base


def routed_fetch(base, dq, slots, unit, i: int):
    """A routed fetch of sparse unit ``i`` (its attention and every second expert) into byte slot 1, whose
    bytes and weights were set to other values first: (the parts fetched, their element ranges, the
    byte ranges copied)."""
    routed = [unit.parts[0], *unit.experts[1::2]]
    ranges = unit.ranges(routed)
    host, copies = base.fetch(i, ranges)
    slots[1].fill_(0xFF)
    dq.weight_slots[1].fill_(7.0)
    for a, b in copies:
        slots[1][a:b].copy_(host[a:b])
    return routed, ranges, copies


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe", "qwen3"])
@pytest.mark.parametrize("fmt,dtype", [("nf4", torch.bfloat16), ("int8", torch.float32)], ids=["nf4-bf16", "int8-fp32"])
def test_routed_fetches_of_a_quantized_sparse_layer(arch, fmt, dtype):
    cfg = _config(arch)
    base, layout = _base(cfg, fmt, dtype), StoreLayout.build(cfg)
    slots = [torch.zeros(base.layout.largest(range(len(layout.units))), dtype=torch.uint8) for _ in range(2)]
    dq = DeviceDequant(base.layout, layout.templates, slots, dtype)
    sparse = [u for u in layout.layers if u.parts]
    assert bool(sparse) == (arch != "qwen3")
    for unit in layout.records:
        i = unit.index
        host, copies = base.fetch(i, None)
        assert copies is None
        slots[0][:host.numel()].copy_(host)
        slot_view = dq.weights(0, i, None)
        whole = slot_view.clone()
        params = base.params(i)
        for name, view in layout.templates[i].bind(whole).items():
            assert torch.equal(view, params[name]), (unit.name, name)  # the batched runs are each record's
        q = base.layout.units[i]
        assert q.raw == (unit.layer is None)
        if unit.layer is None:
            assert slot_view.data_ptr() == slots[0].data_ptr()  # a raw unit is read in place
        for r in q.records:
            assert (r.fmt != RAW) == quantized(unit.name, r.name, r.shape)
        if not unit.parts:
            continue
        routed, ranges, copies = routed_fetch(base, dq, slots, unit, i)  # attention and every second expert
        assert sum(b - a for a, b in copies) < q.nbytes * 0.8
        got = layout.templates[i].bind(dq.weights(1, i, ranges))
        inside = {n for p in routed for n, _, o in layout.templates[i].params if any(a <= o < b for a, b in p.ranges)}
        assert inside and len(inside) < len(params)
        for name, view in got.items():
            if name in inside:
                assert torch.equal(view, params[name]), (unit.name, name)
            else:
                assert torch.all(view == 7.0), (unit.name, name)  # not fetched: untouched
        experts = [r for r in q.records if ".experts." in r.name]
        assert len(runs(q.records)) < len(q.records) - len(experts) // 2  # the experts in a few runs


def test_a_range_that_cuts_a_parameter_is_refused():
    cfg = _config("qwen3")
    q = QuantLayout.build(cfg, NF4, torch.bfloat16).units[1]
    r = next(r for r in q.records if r.fmt == NF4)
    with pytest.raises(ValueError, match="cuts the quantized parameter"):
        q.byte_ranges([(r.offset, r.offset + 10)])


def test_single_records_dequantize_as_their_run():
    cfg = _config("mixtral")
    base = _base(cfg, NF4, torch.bfloat16)
    block = base.block(1)
    for r in base.layout.units[1].records:
        out = torch.empty(r.numel, dtype=torch.bfloat16)
        assert torch.equal(dequantize(r, block, out).view(r.shape), base.params(1)[r.name])


def test_bytes_per_parameter():
    cfg = ModelConfig.from_hf_dict({**make_model("llama2").config.to_dict(), "hidden_size": 1024,
                                    "intermediate_size": 2816, "num_attention_heads": 8, "num_key_value_heads": 8})
    layers, _ = bytes_per_param(cfg, "nf4", torch.bfloat16)
    assert 0.5 + 1 / 64 < layers < 0.53  # 4 bits, an absmax code per 64, absmax2 per 16384, the norms raw
    layers8, whole8 = bytes_per_param(cfg, "int8", torch.bfloat16)
    assert 1.0 < layers8 < 1.01 and whole8 > layers8  # the embedding and head raw (bf16)


def test_base_format_is_validated_by_name():
    from megatrain_ray.config.load import load_config
    from megatrain_ray.errors import ConfigError

    assert load_config(None, ["lora.rank=4", "lora.base_format=nf4"]).lora.quantized
    with pytest.raises(ConfigError, match="lora.base_format.*one of compute, int8, nf4"):
        load_config(None, ["lora.rank=4", "lora.base_format=fp4"])
    with pytest.raises(ConfigError, match="lora.base_format.*needs lora.rank > 0"):
        load_config(None, ["lora.base_format=nf4"])
