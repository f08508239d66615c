"""Mixtures of experts (Qwen3-MoE, Mixtral, Qwen2-MoE, GLM-4.5) against transformers itself, on the CPU in fp32.

- Logits: a tiny random model of each family (dense and sparse layers mixed where the family allows
  it, Qwen2-MoE's shared expert, several shards) imported into a real shared-memory store gives
  transformers' logits; the experts matter (perturbing one changes them).
- Both checkpoint layouts: the Hub's per-expert tensors (what save_pretrained writes) and the stacked
  3-D tensors of transformers 5's parameters (a state dict saved directly) import to the same
  weights; export writes the per-expert form, which AutoModelForCausalLM loads, with transformers'
  logits and ``generate`` output unchanged.
- The load-balancing loss from our per-layer router statistics equals transformers' aux_loss, and
  its gradient, taken layer by layer through :func:`aux_loss_of_layer`, equals autograd's of the whole
  (gpt-oss's too, its sliding windows applied; GLM-4.5 has none in transformers: its config.json with output_router_logits is refused, naming the key).
- The grouped GEMM (``torch._grouped_mm``, which this torch runs on the CPU in bf16) agrees with the
  per-expert fallback forward and backward, an expert with no rows included (its gradient zero).
- The config: MoE keys read from config.json under either name, errors naming the key.
- FLOPs: active parameters, 6·N_active·T and PaLM's with the routed experts at top-k.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from artifacts import (MOE_ARCHS, hf_logits, import_store, imported_logits_match, make_model,  # noqa: E402
                       read_tensors, save_model, token_ids)

from megatrain_ray.config import ModelConfig  # noqa: E402
from megatrain_ray.errors import ConfigError  # noqa: E402
from megatrain_ray.io import hf_io  # noqa: E402
from megatrain_ray.io.evaluate import forward_logits, store_reader  # noqa: E402
from megatrain_ray.model import flops, grouped, moe  # noqa: E402
from megatrain_ray.model.transformer import (layer_mask, rms_norm, rope_cache, routed_layer, unit_names,  # noqa: E402
                                              unit_params)

SPARSE = {"qwen3_moe": (0, 2), "mixtral": (0, 1), "qwen2_moe": (1, 3), "glm4_moe": (1, 2)}
NO_AUX_LOSS = {"glm4_moe"}
"""Families transformers computes no load-balancing loss for (output_router_logits is refused)."""


@pytest.mark.parametrize("arch", sorted(MOE_ARCHS))
def test_imported_logits_match_transformers(arch, tmp_path, shm_dir):
    model, store, ids, theirs = imported_logits_match(arch, tmp_path / "hf", shm_dir)
    try:
        cfg = store.spec.model
        assert cfg.sparse_layers == SPARSE[arch]
        # The experts matter: one expert's weights changed moves the logits.
        unit = f"layers.{cfg.sparse_layers[0]}"
        p = store.store.params("master", store.store.layout.units.index(unit))
        p[moe.names(cfg).expert(1)[2]].mul_(3.0)
        moved = forward_logits(cfg, store_reader(store.store), ids)
        assert (moved - theirs).abs().max() > 1e-3
    finally:
        store.close()


def _save_stacked(model, directory):
    """transformers 5's parameters (experts stacked in 3-D) saved directly, with config.json."""
    directory.mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    half = len(state) // 2  # two shards with an index, as a sharded checkpoint
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    for name, ks in shards.items():
        save_file({k: state[k] for k in ks}, str(directory / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, ks in shards.items() for k in ks}}
    (directory / hf_io.INDEX_FILE).write_text(json.dumps(index))
    model.config.save_pretrained(directory)


@pytest.mark.parametrize("arch", sorted(MOE_ARCHS))
def test_both_expert_layouts_import_and_export_loads_in_transformers(arch, tmp_path, shm_dir):
    model = save_model(arch, tmp_path / "hub")
    _save_stacked(model, tmp_path / "stacked")
    hub, stacked = import_store(tmp_path / "hub", shm_dir), import_store(tmp_path / "stacked", shm_dir)
    try:
        a, b = hub.state_dict(), stacked.state_dict()
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
        names = moe.names(hub.spec.model)
        assert f"model.layers.{SPARSE[arch][0]}.{names.expert(3)[1]}" in a  # the per-expert form
        hf_io.save_store(stacked.store, str(tmp_path / "out"), shard_bytes=40_000)
    finally:
        hub.close()
        stacked.close()
    written = read_tensors(tmp_path / "out")
    assert not any("gate_up_proj" in k for k in written)
    # Per-expert export of the stacked import: the same tensors as save_pretrained wrote.
    assert set(written) == set(read_tensors(tmp_path / "hub"))
    assert all(torch.equal(v, read_tensors(tmp_path / "hub")[k]) for k, v in written.items())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert type(loaded) is type(model)
    ids = token_ids()
    torch.testing.assert_close(hf_logits(loaded, ids), hf_logits(model, ids), rtol=0, atol=0)
    prompt = ids[:1, :5]
    assert torch.equal(loaded.generate(prompt, max_new_tokens=8, do_sample=False),
                       model.generate(prompt, max_new_tokens=8, do_sample=False))
    # And the export command on the stacked directory writes the per-expert form too.
    summary = hf_io.export(str(tmp_path / "stacked"), str(tmp_path / "exported"))
    assert summary["tensors"] == len(written)
    assert set(read_tensors(tmp_path / "exported")) == set(written)


@pytest.mark.parametrize("arch", [*sorted(MOE_ARCHS), "gpt_oss"])
def test_aux_loss_and_its_layerwise_gradient_match_transformers(arch, tmp_path):
    model = make_model(arch, output_router_logits=True)
    model.save_pretrained(tmp_path / "hf")
    if arch in NO_AUX_LOSS:
        assert getattr(model(input_ids=token_ids()), "aux_loss", None) is None
        with pytest.raises(ConfigError, match=r"model\.output_router_logits"):
            hf_io.read_config(str(tmp_path / "hf"))
        return
    cfg, _ = hf_io.read_config(str(tmp_path / "hf"))
    mapping = hf_io.check_weights(cfg, str(tmp_path / "hf"), "the checkpoint")
    ids = token_ids(batch=2, seq=16)
    with torch.no_grad():
        theirs = model(input_ids=ids).aux_loss
    units = {u: hf_io.read_unit(str(tmp_path / "hf"), mapping, cfg, u) for u in unit_names(cfg)}
    x = torch.nn.functional.embedding(ids, units["embed"]["weight"])
    rope = rope_cache(cfg, ids.shape[1], ids.device, torch.float32)
    stats = []
    from megatrain_ray.model.transformer import decoder_layer

    for i in range(cfg.num_hidden_layers):
        p, mask = units[f"layers.{i}"], layer_mask(cfg, i, None, ids.shape[1], ids.device)  # gpt-oss: its windows
        if i in cfg.sparse_layers:
            x, s = routed_layer(p, x, rope, cfg, mask)
            stats.append(s)
        else:
            x = decoder_layer(p, x, rope, cfg, mask)
    ours = moe.aux_loss(stats, cfg.num_experts)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=1e-7)
    assert theirs > 1.0  # E x sum f P is k (2) at perfect balance, more otherwise

    # The layer-by-layer gradient (f fixed, as a count) is autograd's of the whole loss.
    probs = [torch.randn(32, cfg.num_experts).softmax(-1).requires_grad_(True) for _ in stats]
    made = [moe.RouterStats(s.counts, p.sum(0), s.rows, s.assigned) for s, p in zip(stats, probs)]
    whole = torch.autograd.grad(moe.aux_loss(made, cfg.num_experts), probs)
    total = torch.stack([s.counts for s in made]).sum(0)
    rows = sum(s.rows for s in made)
    for s, p, g in zip(made, probs, whole):
        (mine,) = torch.autograd.grad(moe.aux_loss_of_layer(s, total, rows, cfg.num_experts), p)
        torch.testing.assert_close(mine, g)


def test_grouped_gemm_matches_the_per_expert_fallback_with_an_idle_expert():
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 9, 2])  # expert 1 gets no row
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 24, 32, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(16, 24, dtype=torch.bfloat16)
    out = {}
    for name in ("grouped", "fallback"):
        xi, wi = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
        y = (grouped._grouped_mm()(xi, wi.transpose(-2, -1), offs=counts.cumsum(0).to(torch.int32))
             if name == "grouped" else grouped.grouped_linear(xi, wi, counts))
        y.backward(dy)
        out[name] = (y.float(), xi.grad.float(), wi.grad.float())
    assert not grouped.grouped_kernel(x, w)  # the CPU takes the fallback in training
    for a, b in zip(out["grouped"], out["fallback"]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)  # bf16: each rounds its own fp32 sums
    assert torch.count_nonzero(out["fallback"][2][1]) == 0 and torch.count_nonzero(out["grouped"][2][1]) == 0
    # fp32 reference of the same rows, one matmul per expert
    ref = torch.cat([x[a:b].float() @ w[e].float().t() for e, (a, b) in
                     enumerate(zip([0, 5, 5, 14], [5, 5, 14, 16]))])
    torch.testing.assert_close(out["grouped"][0], ref, rtol=2e-2, atol=5e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_gpu_grouped_gemm_layer_matches_the_per_expert_path():
    """On a GPU in bf16 the routed experts run as grouped GEMMs; the same routing through the per-expert
    path (on the CPU in fp32, the reference) gives the same output and gradients within bf16
    rounding, an idle expert's gradient exactly zero in both."""
    cfg = ModelConfig(model_type="qwen3_moe", num_experts=16, num_experts_per_tok=2, moe_intermediate_size=128,
                      hidden_size=256, num_attention_heads=4, num_hidden_layers=1)
    cfg.validate()
    torch.manual_seed(0)
    ref = {n: torch.randn(shape) * shape[-1] ** -0.5 for n, shape in moe.sparse_params(cfg)}
    x = torch.randn(6, 256)  # 6 tokens x top-2 of 16: idle experts
    _, weights, experts = moe.route(ref, x, cfg)  # one routing for both
    outs = {}
    for device, dtype in (("cuda", torch.bfloat16), ("cpu", torch.float32)):
        p = {n: v.to(device, dtype).requires_grad_(True) for n, v in ref.items()}
        xi = x.to(device, dtype)
        assert grouped.grouped_kernel(xi, moe.expert_weights(p, cfg)[0]) == (device == "cuda")
        out, counts = moe.routed_experts(p, xi, weights.to(device, dtype), experts.to(device), cfg)
        out.float().square().sum().backward()
        outs[device] = (out.float().cpu(), {n: v.grad.float().cpu() for n, v in p.items() if v.grad is not None},
                        counts.cpu())
    (a, ga, ca), (b, gb, cb) = outs["cuda"], outs["cpu"]
    assert torch.equal(ca, cb)
    torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)
    idle = int((cb == 0).nonzero()[0])
    for name in moe.names(cfg).expert(idle):
        assert torch.count_nonzero(ga[name]) == torch.count_nonzero(gb[name]) == 0
    assert set(ga) == set(gb)
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=5e-2, atol=5e-2 * gb[name].abs().max().item())


def test_an_expert_without_tokens_has_an_exactly_zero_gradient():
    cfg = ModelConfig(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=1, moe_intermediate_size=16,
                      hidden_size=32, num_attention_heads=2, num_hidden_layers=1)
    cfg.validate()
    torch.manual_seed(0)
    p = {name: torch.randn(shape, requires_grad=True) for name, shape in unit_params(cfg, "layers.0")}
    x = torch.randn(1, 3, 32)  # 3 tokens, top-1 of 4: at least one expert idle
    h = rms_norm(x, p["post_attention_layernorm.weight"], cfg.rms_norm_eps)
    out, stats = moe.sparse_mlp(p, h, cfg)
    assert stats.counts.sum() == 3
    idle = int((stats.counts == 0).nonzero()[0])
    out.square().sum().backward()
    for name in moe.names(cfg).expert(idle):
        assert torch.count_nonzero(p[name].grad) == 0
    for name in moe.names(cfg).expert(int(stats.counts.argmax())):
        assert torch.count_nonzero(p[name].grad) > 0


def test_moe_config_keys_from_config_json_and_back():
    hf = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                                     num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                     decoder_sparse_step=2, mlp_only_layers=[3], output_router_logits=True,
                                     router_aux_loss_coef=0.01).to_dict()
    assert "num_local_experts" in hf  # transformers 5's name; the Hub's configs say num_experts
    for form in (hf, {**{k: v for k, v in hf.items() if k != "num_local_experts"}, "num_experts": 8}):
        cfg = ModelConfig.from_hf_dict(form)
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.expert_size) == (8, 2, 32)
        assert cfg.sparse_layers == (1,) and cfg.norm_topk_prob and cfg.output_router_logits
        assert cfg.router_aux_loss_coef == 0.01
        back = transformers.Qwen3MoeConfig(**cfg.to_hf_dict())
        assert (back.num_experts, back.mlp_only_layers, back.decoder_sparse_step) == (8, [3], 2)
    mix = ModelConfig.from_hf_dict(transformers.MixtralConfig(num_local_experts=8).to_dict())
    assert mix.num_experts == 8 and mix.norm_topk_prob and mix.expert_size == mix.intermediate_size
    assert transformers.MixtralConfig(**mix.to_hf_dict()).num_local_experts == 8
    q2 = ModelConfig.from_hf_dict(transformers.Qwen2MoeConfig(qkv_bias=False).to_dict())
    assert q2.attention_bias is False and q2.shared_expert_intermediate_size == 5632
    dense = ModelConfig.from_hf_dict(transformers.Qwen2Config().to_dict())
    assert not any(k in dense.to_hf_dict() for k in ("num_experts", "mlp_only_layers"))


@pytest.mark.parametrize("change,key", [
    (dict(num_experts_per_tok=5), "model.num_experts_per_tok"),
    (dict(mlp_only_layers=[7]), "model.mlp_only_layers"),
    (dict(num_experts=0), "model.num_experts"),
    (dict(model_type="qwen3", num_experts=4), "model.num_experts"),
    (dict(model_type="mixtral", decoder_sparse_step=2), "model.decoder_sparse_step"),
    (dict(model_type="mixtral", norm_topk_prob=False), "model.norm_topk_prob"),
    (dict(model_type="qwen2_moe", shared_expert_intermediate_size=0), "model.shared_expert_intermediate_size"),
])
def test_bad_moe_settings_name_the_key(change, key):
    base = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                num_hidden_layers=2)
    if change.get("model_type") == "qwen2_moe":
        base["shared_expert_intermediate_size"] = 32
    if change.get("model_type") == "mixtral":
        del base["moe_intermediate_size"]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        ModelConfig(**{**base, **change}).validate()
    with pytest.raises(ConfigError, match="router_jitter_noise"):
        ModelConfig.from_hf_dict(transformers.MixtralConfig(router_jitter_noise=0.1).to_dict())


@pytest.mark.parametrize("arch", sorted(MOE_ARCHS))
def test_active_parameters_and_flops_count_routed_experts_at_top_k(arch):
    model = make_model(arch)
    cfg = ModelConfig.from_hf_dict(model.config.to_dict())
    total = sum(p.numel() for p in model.parameters())  # tied: counted once by parameters()
    total += sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))  # held too
    assert flops.num_params(cfg) == total
    per_expert = 3 * cfg.hidden_size * cfg.expert_size
    skipped = len(cfg.sparse_layers) * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert
    assert flops.active_params(cfg) == total - skipped
    assert flops.flops_6nt(cfg, 1000) == 6.0 * (total - skipped) * 1000
    # PaLM: every 2-D weight a token multiplies (experts at top-k, the tied head once as the LM head).
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and "embed_tokens" not in n
                 and ".experts." not in n)
    matmul += len(cfg.sparse_layers) * cfg.num_experts_per_tok * per_expert
    if cfg.tie_word_embeddings:
        matmul += cfg.vocab_size * cfg.hidden_size
    assert flops.matmul_params(cfg) == matmul
    dense = ModelConfig(model_type="qwen2", hidden_size=64, intermediate_size=112, num_hidden_layers=2)
    assert flops.active_params(dense) == flops.num_params(dense)
