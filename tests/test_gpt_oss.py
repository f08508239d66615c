"""gpt-oss against transformers' own GptOssForCausalLM, on the CPU in fp32.

- Logits: a tiny random model (sliding window 4 on layer 0 over 24-token sequences, full attention
  on layer 1, sinks, biases everywhere, YaRN, the clamped SwiGLU with clamps that bind) imported
  from save_pretrained's shards gives transformers' logits within 1e-5 (the same fp32 ops, summed in
  other orders); each gpt-oss piece matters: a changed expert, sink, router bias, expert bias or a
  window left out moves them.
- Export: the store written back (save_store, and the export command) is the Hub's stacked form,
  interleaved as transformers holds it, tensor for tensor equal to what save_pretrained wrote.
- MXFP4: our dequantization equals transformers' bit for bit on random blocks (fp32 and bf16), and
  an MXFP4 checkpoint imports to the weights transformers dequantizes from it (into an MXFP4 base as
  it is: tests/test_quant_mxfp4.py).
- YaRN's tables (the load-balancing loss: tests/test_moe_model.py, gpt_oss among the families there).
- The config: from config.json and back, errors naming the key.
- FLOPs: active parameters (an expert's biases with it), the window in PaLM's attention term, and
  the presets' totals as published (20.9B and 116.8B; 3.6B and 5.1B active without the embedding).
"""

import json

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from artifacts import hf_logits, import_store, imported_logits_match, make_model, read_tensors, token_ids  # noqa: E402

from megatrain_ray.config import ModelConfig  # noqa: E402
from megatrain_ray.errors import ConfigError  # noqa: E402
from megatrain_ray.io import hf_io  # noqa: E402
from megatrain_ray.io.evaluate import forward_logits, store_reader  # noqa: E402
from megatrain_ray.model import flops, moe, presets  # noqa: E402
from megatrain_ray.model.mxfp4 import dequantize_blocks  # noqa: E402
from megatrain_ray.model.transformer import rms_norm, rope_cache  # noqa: E402


def _moved(store, cfg, ids, theirs, name, change, layer=0):
    p = store.store.params("master", store.store.layout.units.index(f"layers.{layer}"))
    saved = p[name].clone()
    change(p[name])
    moved = (forward_logits(cfg, store_reader(store.store), ids) - theirs).abs().max()
    p[name].copy_(saved)
    return moved


def test_imported_logits_match_transformers_and_each_piece_matters(tmp_path, shm_dir):
    model, store, ids, theirs = imported_logits_match("gpt_oss", tmp_path / "hf", shm_dir)
    try:
        cfg = store.spec.model
        assert cfg.sparse_layers == (0, 1) and cfg.window(0) == 4 and cfg.window(1) is None
        assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.o_proj_bias and cfg.attention_sinks
        n = moe.names(cfg)
        for name in (n.expert(1)[2], n.expert_bias(2)[0], n.router_bias, "self_attn.sinks"):
            assert _moved(store, cfg, ids, theirs, name, lambda t: t.view(-1)[:2].add_(2.0)) > 1e-3, name
        # The window: the same weights with full attention on layer 0 give other logits.
        full = ModelConfig(**{**cfg.__dict__, "layer_types": ["full_attention"] * 2})
        assert (forward_logits(full, store_reader(store.store), ids) - theirs).abs().max() > 1e-3
        # The clamps bind: some expert pre-activation of (normed) inputs exceeds the limit.
        p = store.store.params("master", store.store.layout.units.index("layers.0"))
        x = rms_norm(torch.nn.functional.embedding(ids, store.store.params("master", 0)["weight"]),
                     p["post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate_up, _ = moe.expert_weights(p, cfg)
        assert (torch.einsum("bsh,eoh->bseo", x, gate_up).abs() > cfg.swiglu_limit).any()
    finally:
        store.close()


def test_export_writes_the_hub_stacked_form_that_transformers_loads(tmp_path, shm_dir):
    model = make_model("gpt_oss")
    model.save_pretrained(tmp_path / "hub", max_shard_size="40KB")
    store = import_store(tmp_path / "hub", shm_dir)
    try:
        assert "model.layers.1.mlp.experts.3.up_proj.bias" in store.state_dict()  # this project's form
        hf_io.save_store(store.store, str(tmp_path / "out"), shard_bytes=40_000)
    finally:
        store.close()
    written, hub = read_tensors(tmp_path / "out"), read_tensors(tmp_path / "hub")
    assert set(written) == set(hub) and all(torch.equal(v, hub[k]) for k, v in written.items())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert type(loaded) is type(model)
    ids = token_ids()
    torch.testing.assert_close(hf_logits(loaded, ids), hf_logits(model, ids), rtol=0, atol=0)
    summary = hf_io.export(str(tmp_path / "hub"), str(tmp_path / "exported"))
    exported = read_tensors(tmp_path / "exported")
    assert summary["tensors"] == len(hub) and all(torch.equal(v, hub[k]) for k, v in exported.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantization_is_transformers_bit_for_bit(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=g, dtype=torch.uint8)  # [E, rows, in/32, 16]
    scales = torch.randint(110, 140, (3, 8, 2), generator=g, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, rows]
    ours = dequantize_blocks(blocks, scales, dtype)  # [E, rows, in]
    assert ours.dtype == dtype and torch.equal(ours.transpose(1, 2), theirs)
    assert torch.equal(dequantize_blocks(blocks, scales).to(dtype), ours)  # fp32 then cast: the same bits


def test_an_mxfp4_checkpoint_imports_to_transformers_dequantized_weights(tmp_path, shm_dir):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = make_model("gpt_oss")
    cfg = model.config
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator().manual_seed(1)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    for layer in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        for proj, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(120, 130, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
            del state[prefix + proj]
            state[prefix + proj + "_blocks"], state[prefix + proj + "_scales"] = blocks, scales
            with torch.no_grad():  # the reference: transformers' dequantization into its parameter
                getattr(model.model.layers[layer].mlp.experts, proj).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    (tmp_path / "mxfp4").mkdir()
    save_file(state, str(tmp_path / "mxfp4" / "model.safetensors"), metadata={"format": "pt"})
    config = cfg.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))
    store = import_store(tmp_path / "mxfp4", shm_dir)
    try:
        ids = token_ids()
        ours = forward_logits(store.spec.model, store_reader(store.store), ids)
        torch.testing.assert_close(ours, hf_logits(model, ids), rtol=1e-5, atol=1e-5)
        hf_io.save_store(store.store, str(tmp_path / "out"))
    finally:
        store.close()
    written = read_tensors(tmp_path / "out")
    for k, v in model.state_dict().items():
        assert torch.equal(written[k], v), k  # dequantized exactly, written in the bf16 form's layout


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_tables_match_transformers(truncate):
    hf = transformers.GptOssConfig(head_dim=64, rope_parameters={
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate,
        "original_max_position_embeddings": 4096, "rope_theta": 150000.0})
    rotary = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(hf)
    cfg = ModelConfig.from_hf_dict(hf.to_dict())
    pos = torch.arange(5000)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos)
    ours = rope_cache(cfg, 5000, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(ours[0], torch.cat((cos[0], cos[0]), -1), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours[1], torch.cat((sin[0], sin[0]), -1), rtol=0, atol=1e-6)


def test_gpt_oss_config_from_config_json_and_back():
    hf = transformers.GptOssConfig(num_hidden_layers=4).to_dict()
    cfg = ModelConfig.from_hf_dict(hf)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.expert_size, cfg.sliding_window) == (128, 4, 2880, 128)
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2 and cfg.attention_bias
    assert cfg.sparse_layers == (0, 1, 2, 3) and (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0)
    back = transformers.GptOssConfig(**cfg.to_hf_dict())
    for key in ("num_local_experts", "layer_types", "sliding_window", "swiglu_limit", "attention_bias", "head_dim"):
        assert getattr(back, key) == hf[key], key
    assert "layer_types" not in ModelConfig().to_hf_dict()


@pytest.mark.parametrize("change,key", [
    (dict(layer_types=["full_attention"]), "model.layer_types"),
    (dict(layer_types=["sliding_attention", "nope"]), "model.layer_types"),
    (dict(sliding_window=None), "model.sliding_window"),
    (dict(swiglu_limit=-1.0), "model.swiglu_limit"),
    (dict(decoder_sparse_step=2), "model.decoder_sparse_step"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1}),
     "model.rope_scaling.mscale"),
    (dict(model_type="qwen3_moe", moe_intermediate_size=16), "model.layer_types"),
])
def test_bad_gpt_oss_settings_name_the_key(change, key):
    base = dict(model_type="gpt_oss", num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        ModelConfig(**{**base, **change}).validate()


def test_active_parameters_flops_and_presets():
    model = make_model("gpt_oss")
    cfg = ModelConfig.from_hf_dict(model.config.to_dict())
    total = sum(p.numel() for p in model.parameters())
    assert flops.num_params(cfg) == total
    per_expert = sum(p[0].numel() for n, p in model.model.layers[0].mlp.experts.named_parameters())
    assert flops.expert_params(cfg) == per_expert
    skipped = cfg.num_hidden_layers * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert
    assert flops.active_params(cfg) == total - skipped
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and "embed_tokens" not in n
                 and "experts" not in n) + cfg.num_hidden_layers * cfg.num_experts_per_tok * 3 * 64 * 32
    assert flops.matmul_params(cfg) == matmul
    q = cfg.num_attention_heads * cfg.head_size
    assert flops.attention_flops_per_token(cfg, 24) == 12 * (4 + 24) * q  # layer 0 sees 4 keys, layer 1 all 24
    for name, total, active in (("gpt-oss-20b", 20.91e9, 3.61e9), ("gpt-oss-120b", 116.83e9, 5.13e9)):
        big = presets.preset_model(name)
        big.validate()
        embed = big.vocab_size * big.hidden_size
        assert abs(flops.num_params(big) - total) < 0.01e9 and abs(flops.active_params(big) - embed - active) < 0.01e9
