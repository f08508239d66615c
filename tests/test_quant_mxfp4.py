"""MXFP4 (lora.base_format mxfp4; megatrain_ray.model.mxfp4) against torchao's quantizer and transformers' dequantization.

- Quantizing gives torchao's MX conversion (``to_mx``, FLOOR scale mode, fp4 e2m1) byte for byte
  (codes, low nibble first, and e8m0 scales) in fp32 and bf16, over magnitudes from 1e-30 to 1e30,
  exact ties, saturation and signed zeros; and, everywhere (the blocks of scale byte 0 too, where
  torchao divides by 2^-126 instead of the block's 2^-127), the OCP rule by exhaustive search: the
  scale of floor(log2(absmax)) - 2, each element the nearest of the 16 e2m1 values, ties to the
  even code. Quantizing a dequantized weight gives its codes and scales back.
- Dequantizing gives transformers' ``convert_moe_packed_tensors`` bit for bit for every code and every
  scale byte, k weights at a time and in chunks.
- The layout: the routed experts' weights alone are MXFP4 records, in every family; a routed fetch
  moves only its experts' bytes and dequantizes them as the whole unit's dequantization does (as
  tests/test_quant_store.py checks for nf4); its bytes per parameter.
- The store: a gpt-oss MXFP4 checkpoint goes into an mxfp4 base as it is (its blocks and scales are
  the records' bytes, its dequantized experts transformers'); into an nf4 base dequantized once; a
  checkpoint in floats is quantized at load (torchao's bytes).
- The config: a dense model, and experts whose rows are not whole blocks, are refused by name.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
torchao_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402

from artifacts import import_store, make_model  # noqa: E402
from test_quant_store import _base, _config, routed_fetch  # noqa: E402
from megatrain_ray.config.model import ModelConfig  # noqa: E402
from megatrain_ray.engine.store.quantized import DeviceDequant, runs  # noqa: E402
from megatrain_ray.model import mxfp4 as M  # noqa: E402
from megatrain_ray.model.layout import StoreLayout  # noqa: E402
from megatrain_ray.model.moe import EXPERT, part_of  # noqa: E402
from megatrain_ray.model.quant import quantize_nf4  # noqa: E402
from megatrain_ray.model.quant_layout import MXFP4, RAW, bytes_per_param  # noqa: E402


def torchao_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., in] (fp32/bf16) -> torchao's (codes [..., in / 2] uint8, scales [..., in / 32] uint8)."""
    scales, data = torchao_mx.to_mx(w.contiguous(), torch.float4_e2m1fn_x2, 32, torchao_mx.ScaleCalculationMode.FLOOR)
    return data.view(torch.uint8).reshape(*w.shape[:-1], -1), scales.view(torch.uint8).reshape(*w.shape[:-1], -1)


def mx_round_trip(w: torch.Tensor) -> torch.Tensor:
    """w [E, rows, in] -> torchao's MXFP4 of it dequantized by transformers (the reference base), same shape/dtype."""
    codes, scales = torchao_mxfp4(w)
    e, rows, cols = w.shape
    return convert_moe_packed_tensors(codes.view(e, rows, cols // 32, 16), scales, dtype=w.dtype).transpose(1, 2)


def _weight(rows, cols, dtype, seed=0):
    """Rows of magnitudes from 1e-30 to 1e30, with exact ties, saturating values, an all-zero block and signed zeros."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-30, 30, rows)[:, None]
    w[0, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])  # block absmax 6: exponent 0, every tie
    w[0, 8:16] = -w[0, :8]
    w[1, :32] = torch.linspace(-7.9, 7.9, 32)  # absmax 7.9: 5.5 .. 7.9 saturate at 6
    w[2, :32] = 0.0
    w[2, 32:64] = -0.0
    w[3, 5] = -0.0
    return w.to(dtype)


def _brute_force(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The OCP rule by exhaustive search: per block the scale 2^(floor(log2 absmax) - 2), clamped to
    [-127, 127], and per element the code of the nearest of the 16 values (in float64), ties to the
    even code and the sign kept on zero; codes packed low nibble first."""
    x = w.double().reshape(-1, 32)
    absmax = x.abs().amax(1)
    exponent = torch.where(absmax > 0, torch.floor(torch.log2(absmax.clamp(min=1e-300))) - 2, torch.tensor(-127.0))
    exponent = exponent.clamp(-127, 127)
    scaled = x / torch.pow(2.0, exponent)[:, None]
    values = torch.tensor(M.FP4_VALUES, dtype=torch.float64)
    dist = (scaled[..., None] - values).abs()
    dist = dist + 1e-9 * (torch.arange(16) % 2)  # a tie goes to the even code (mantissa bit 0)
    dist = dist + 1e-12 * ((torch.arange(16) >= 8) != torch.signbit(scaled)[..., None])  # zero keeps the sign
    codes = dist.argmin(-1).to(torch.uint8).reshape(-1)
    return codes[0::2] | (codes[1::2] << 4), (exponent + 127).to(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantize_is_torchao_and_the_ocp_rule_bit_for_bit(dtype):
    w = _weight(64, 256, dtype)
    codes, scales = M.quantize_mxfp4(w)
    assert codes.shape == (64 * 128,) and scales.shape == (64 * 8,)
    want = _brute_force(w)
    assert torch.equal(codes, want[0]) and torch.equal(scales, want[1])
    assert scales[2 * 8] == 0 and torch.all(codes[2 * 128:2 * 128 + 16] == 0)  # all +0: scale byte 0, codes 0
    assert torch.all(codes[2 * 128 + 16:2 * 128 + 32] == 0x88)  # all -0.0: the codes of -0
    theirs = torchao_mxfp4(w)
    away = (scales > 0).repeat_interleave(16) | (codes == 0)  # torchao's scale-0 blocks: see the docstring
    assert torch.equal(scales, theirs[1].reshape(-1))
    assert torch.equal(codes[away], theirs[0].reshape(-1)[away]) and away.float().mean() > 0.7
    tiny = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).to(dtype) * 1e-38  # scale byte 0 blocks
    assert all(torch.equal(a, b) for a, b in zip(M.quantize_mxfp4(tiny), _brute_force(tiny)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_round_trip_gives_the_codes_and_scales_back(dtype):
    codes, scales = M.quantize_mxfp4(_weight(64, 256, torch.float32, seed=2))
    out = torch.empty(64, 256, dtype=dtype)
    M.dequantize_mxfp4(codes.view(64, 128), scales.view(64, 8), out)
    again = M.quantize_mxfp4(out)
    assert torch.equal(again[0], codes) and torch.equal(again[1], scales)


@pytest.mark.parametrize("dtype,bits", [(torch.float32, torch.int32), (torch.bfloat16, torch.int16)], ids=["fp32", "bf16"])
def test_dequantize_is_transformers_bit_for_bit_for_every_scale(dtype, bits, monkeypatch):
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 256, 3, 16), generator=g, dtype=torch.uint8)  # [E, rows, in/32, 16]
    scales = torch.arange(256, dtype=torch.uint8).view(1, 256, 1).expand(2, 256, 3).contiguous()  # every scale byte
    scales[1] = scales[1].flip(0)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2).contiguous()  # [E, rows, in]
    ours = M.dequantize_blocks(blocks, scales, dtype)
    assert torch.equal(ours.view(bits), theirs.view(bits))  # bits: inf and nan where transformers has them
    assert torch.isinf(ours).any() and not torch.isnan(ours).any()
    # k weights at a time, in chunks of 2 blocks: the same
    monkeypatch.setattr(M, "DEQUANT_CHUNK", 2 * 2 * M.MX_BLOCK)
    out = torch.empty(2, 256 * 96, dtype=dtype)
    M.dequantize_mxfp4(blocks.view(2, -1), scales.view(2, -1), out)
    assert torch.equal(out.view(bits), theirs.view(2, -1).view(bits))


@pytest.mark.parametrize("arch,kw", [("qwen3_moe", {}), ("qwen2_moe", {}), ("mixtral", dict(intermediate_size=64)),
                                     ("glm4_moe", {}), ("gpt_oss", {})])
def test_the_routed_experts_alone_are_mxfp4_and_a_routed_fetch_moves_their_bytes(arch, kw):
    cfg = _config(arch, **kw)
    base, layout = _base(cfg, MXFP4, torch.bfloat16), StoreLayout.build(cfg)
    slots = [torch.zeros(base.layout.largest(range(len(layout.units))), dtype=torch.uint8) for _ in range(2)]
    dq = DeviceDequant(base.layout, layout.templates, slots, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for unit in layout.records:
        i, q = unit.index, base.layout.units[unit.index]
        for r in q.records:  # the experts' weights, in every family; not the shared experts, routers, attention
            assert (r.fmt == MXFP4) == (unit.layer is not None and part_of(r.name)[0] == EXPERT
                                        and r.name.endswith(".weight")), (unit.name, r.name)
        expected = {}
        for j, (name, shape, _) in enumerate(layout.templates[i].params):  # written again: the bytes are quantize's
            value = torch.randn(shape, generator=g) * 0.05
            base.write(i, name, value)
            r = base.record(i, name)
            if r.fmt == MXFP4:
                codes, scales = M.quantize_mxfp4(value.to(torch.bfloat16))
                block = base.block(i)
                assert torch.equal(block[r.pieces[0][0]:r.pieces[0][1]], codes)
                assert torch.equal(block[r.pieces[1][0]:r.pieces[1][1]], scales)
                expected[name] = mx_round_trip(value.to(torch.bfloat16)[None])[0]
        params = base.params(i)
        assert all(torch.equal(params[n], v) for n, v in expected.items())  # torchao's, dequantized by transformers
        assert bool(expected) == bool(unit.parts)  # a dense layer, the embedding, the head: raw
        if not unit.parts:
            continue
        host, _ = base.fetch(i, None)
        slots[0][:host.numel()].copy_(host)
        whole = layout.templates[i].bind(dq.weights(0, i, None).clone())
        assert all(torch.equal(whole[n], params[n]) for n in params)
        _, ranges, copies = routed_fetch(base, dq, slots, unit, i)  # attention and every second expert
        left = [r for r in q.records if r not in q.covered(ranges)]
        assert left and sum(b - a for a, b in copies) <= q.nbytes - sum(r.end - r.start for r in left)
        got = layout.templates[i].bind(dq.weights(1, i, ranges))
        for r in q.records:
            assert torch.equal(got[r.name], params[r.name]) if r not in left else torch.all(got[r.name] == 7.0)
        assert len(runs(q.records)) <= len(q.records) - 2 * (len(unit.experts) - 1)  # each projection's experts a run


def test_bytes_per_parameter():
    cfg = ModelConfig(model_type="qwen3_moe", hidden_size=1024, moe_intermediate_size=512, num_experts=64,
                      num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=2)
    layers, whole = bytes_per_param(cfg, MXFP4, torch.bfloat16)
    experts = 64 * 3 * 1024 * 512
    other = StoreLayout.build(cfg).templates[1].param_count - experts
    assert layers == pytest.approx((experts * 4.25 / 8 + other * 2) / (experts + other), rel=1e-3)  # padding aside
    assert whole > layers


def _mxfp4_checkpoint(model, directory, random: bool = False) -> dict:
    """gpt-oss ``model`` saved as the Hub's MXFP4 checkpoint: each experts tensor quantized by torchao into
    ``*_blocks`` / ``*_scales`` (``random``: random codes of magnitude 3 at most instead, scales 120..130,
    which no quantizer gives: it would take a block of absmax 3 x 2^k to the scale 2^(k-1)), and transformers' dequantization of them copied into the model. Returns {"{layer}.{proj}": (blocks, scales)}."""
    from safetensors.torch import save_file

    cfg, out = model.config, {}
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    for layer in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        experts = model.model.layers[layer].mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            w = getattr(experts, proj).detach().transpose(1, 2)  # [E, out, in]
            codes, scales = torchao_mxfp4(w)
            if random:
                g = torch.Generator().manual_seed(layer)
                small = torch.tensor([0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13], dtype=torch.uint8)  # |value| <= 3
                nibbles = small[torch.randint(0, 12, (2, *codes.shape), generator=g)]
                codes = nibbles[0] | (nibbles[1] << 4)
                scales = torch.randint(120, 131, scales.shape, generator=g, dtype=torch.uint8)
            blocks = codes.view(*w.shape[:2], w.shape[2] // 32, 16)
            del state[prefix + proj]
            state[prefix + proj + "_blocks"], state[prefix + proj + "_scales"] = blocks, scales
            with torch.no_grad():
                getattr(experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            out[f"{layer}.{proj}"] = (blocks, scales)
    directory.mkdir(parents=True)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = cfg.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (directory / "config.json").write_text(json.dumps(config))
    return out


def _lora_store(directory, shm_dir, fmt: str):
    from megatrain_ray.engine.store.host_store import ParameterStore, StoreSpec
    from megatrain_ray.io.hf_io import load_train_config
    from megatrain_ray.model.precision import resolve_precision
    import os

    run = load_train_config(None, [f"train.init_from={directory}", "lora.rank=2", f"lora.base_format={fmt}",
                                   "lora.target_modules=q_proj,v_proj", "compute.device=cpu",
                                   "precision.compute_dtype=float32"])
    spec = StoreSpec.of_run(run, resolve_precision(run.precision, "cpu"), "cpu", os.getpid(), "x" + os.urandom(3).hex())
    spec = StoreSpec(spec.model, spec.precision, shm_dir, spec.owner_pid, spec.run_id, lora=spec.lora)
    return ParameterStore(spec, seed=0, init_from=str(directory))


def test_a_gpt_oss_mxfp4_checkpoint_goes_into_an_mxfp4_base_as_it_is(tmp_path, shm_dir):
    """Its blocks and scales are the records' bytes (gate: the rows 0::2 of gate_up_proj_blocks[e], up 1::2,
    down: down_proj_blocks[e]); the store's experts are transformers' dequantization bit for bit; into an nf4
    base the same checkpoint is dequantized once and quantized as nf4; in full fine-tuning, dequantized."""
    model = make_model("gpt_oss")
    packed = _mxfp4_checkpoint(model, tmp_path / "mxfp4", random=True)
    reference = {k: v for k, v in model.state_dict().items()}
    store = _lora_store(tmp_path / "mxfp4", shm_dir, "mxfp4")
    try:
        base, layout = store.store.base, store.store.layout
        for layer in range(model.config.num_hidden_layers):
            i = layout.units.index(f"layers.{layer}")
            block = base.block(i)
            gate_up, down = packed[f"{layer}.gate_up_proj"], packed[f"{layer}.down_proj"]
            for e in range(model.config.num_local_experts):
                for proj, (blocks, scales) in (("gate_proj", (gate_up[0][e, 0::2], gate_up[1][e, 0::2])),
                                               ("up_proj", (gate_up[0][e, 1::2], gate_up[1][e, 1::2])),
                                               ("down_proj", (down[0][e], down[1][e]))):
                    r = base.record(i, f"mlp.experts.{e}.{proj}.weight")
                    assert r.fmt == MXFP4
                    assert torch.equal(block[r.pieces[0][0]:r.pieces[0][1]], blocks.reshape(-1))
                    assert torch.equal(block[r.pieces[1][0]:r.pieces[1][1]], scales.reshape(-1))
        ours = store.state_dict()
        for layer in range(model.config.num_hidden_layers):
            prefix = f"model.layers.{layer}.mlp.experts."
            gate_up, down = reference[prefix + "gate_up_proj"], reference[prefix + "down_proj"]  # [E, H, 2I], [E, I, H]
            for e in range(model.config.num_local_experts):  # transformers' dequantization, bit for bit
                assert torch.equal(ours[f"{prefix}{e}.gate_proj.weight"], gate_up[e][:, 0::2].t())
                assert torch.equal(ours[f"{prefix}{e}.up_proj.weight"], gate_up[e][:, 1::2].t())
                assert torch.equal(ours[f"{prefix}{e}.down_proj.weight"], down[e].t())
        assert torch.equal(ours["model.layers.0.self_attn.q_proj.weight"], reference["model.layers.0.self_attn.q_proj.weight"])
        again = M.quantize_mxfp4(ours["model.layers.0.mlp.experts.0.down_proj.weight"])  # a second quantization
        assert not torch.equal(again[1], packed["0.down_proj"][1][0].reshape(-1))  # would not give these bytes
    finally:
        store.close()
    nf4 = _lora_store(tmp_path / "mxfp4", shm_dir, "nf4")
    try:
        i = nf4.store.layout.units.index("layers.1")
        w = reference["model.layers.1.mlp.experts.down_proj"][2].t()  # expert 2's down [H, I]
        r = nf4.store.base.record(i, "mlp.experts.2.down_proj.weight")
        codes = quantize_nf4(w.contiguous())[0]
        assert torch.equal(nf4.store.base.block(i)[r.pieces[0][0]:r.pieces[0][1]], codes)
    finally:
        nf4.close()
    full = import_store(tmp_path / "mxfp4", shm_dir)
    try:
        assert torch.equal(full.state_dict()["model.layers.1.mlp.experts.2.down_proj.weight"], w)
    finally:
        full.close()


def test_a_checkpoint_in_floats_is_quantized_at_load(tmp_path, shm_dir):
    model = make_model("qwen3_moe")
    model.save_pretrained(tmp_path / "init")
    store = _lora_store(tmp_path / "init", shm_dir, "mxfp4")
    try:
        base = store.store.base
        i = store.store.layout.units.index("layers.0")
        experts = model.model.layers[0].mlp.experts
        gate_up = experts.gate_up_proj.detach()  # [E, 2I, H]
        codes, scales = torchao_mxfp4(gate_up)
        inter = model.config.moe_intermediate_size
        r = base.record(i, "mlp.experts.3.up_proj.weight")
        block = base.block(i)
        assert torch.equal(block[r.pieces[0][0]:r.pieces[0][1]], codes[3, inter:].reshape(-1))
        assert torch.equal(block[r.pieces[1][0]:r.pieces[1][1]], scales[3, inter:].reshape(-1))
        assert torch.equal(store.state_dict()["model.layers.0.mlp.experts.3.up_proj.weight"],
                           mx_round_trip(gate_up)[3, inter:])
        assert base.record(i, "self_attn.q_proj.weight").fmt == RAW
    finally:
        store.close()


def test_mxfp4_is_refused_by_name_where_it_does_not_fit():
    from megatrain_ray.config.load import load_config
    from megatrain_ray.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^lora.base_format mxfp4 .* a llama model without sparse layers has none; "
                                          r"choose nf4 or int8 to quantize its projections\.$"):
        load_config(None, ["lora.rank=4", "lora.base_format=mxfp4"])
    moe = ["model.model_type=qwen3_moe", "model.num_experts=4", "model.num_experts_per_tok=2", "lora.rank=4",
           "lora.base_format=mxfp4"]
    with pytest.raises(ConfigError, match=r"lora.base_format mxfp4 .* model.moe_intermediate_size \(48\) is not a "
                                          r"multiple of 32; choose nf4 or int8"):
        load_config(None, [*moe, "model.moe_intermediate_size=48"])
    assert load_config(None, [*moe, "model.moe_intermediate_size=64"]).lora.quantized


def test_the_plan_prints_the_mxfp4_row_for_a_mixture_of_experts_alone():
    """`megatrain-ray plan`'s LoRA rows: each lora.base_format, mxfp4 with its bytes per parameter of the layers and
    the layers of this shape that fit, for a mixture of experts; none for a dense model."""
    from megatrain_ray.config.load import load_config
    from megatrain_ray.orchestration.store_modes import mode_notes

    moe = load_config(None, ["model.model_type=qwen3_moe", "model.hidden_size=1024", "model.num_experts=64",
                             "model.num_experts_per_tok=4", "model.moe_intermediate_size=512",
                             "model.num_attention_heads=8", "model.num_key_value_heads=8"])
    rows = [line for line in mode_notes(moe, "cuda", 100 * 2**30) if line.startswith("  LoRA")]
    assert [r.split("frozen base, ")[1].split(")")[0] for r in rows] == ["compute", "int8", "nf4", "mxfp4"]
    per_layer = bytes_per_param(moe.model, MXFP4, torch.bfloat16)[0]
    assert f"layer(s) of this shape, {per_layer:.3f} B/param in the layers" in rows[-1]
    layers = [int(r.split("(")[2].split(" layer")[0]) for r in rows]
    assert layers[3] > layers[1] > layers[0] and layers[2] > layers[3]  # mxfp4 holds more than int8, less than nf4
    dense = [line for line in mode_notes(load_config(None, []), "cuda", 100 * 2**30) if line.startswith("  LoRA")]
    assert len(dense) == 3 and not any("mxfp4" in r for r in dense)
