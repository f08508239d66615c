"""GLM-4.5's own parts (glm4_moe), against transformers' Glm4MoeForCausalLM and its config class; the
family's logits, both expert layouts, training and LoRA are in the MoE tests (tests/artifacts.py's
MOE_ARCHS).

- The sigmoid router with its score-correction bias and expert groups (:func:`grouped_route`) chooses
  transformers' Glm4MoeTopkRouter's experts with its weights, fp32 and bf16 inputs; the bias and the
  groups each move some tokens' choice here (the test would see them ignored); a recompute given the
  forward's experts gives its weights bit for bit.
- The bias is held frozen: no gradient reaches it through a sparse layer, AdamW with weight decay
  leaves it bit for bit (its moments stay zero), and optim.decay_norms_and_biases, which would decay
  it, is refused naming the key.
- config.json: GLM-4.5-Air's published one (transformers 4's form, partial_rotary_factor at the top)
  and transformers 5's (inside rope_parameters) read to the glm-4.5-air preset; written back, it
  gives transformers the same config; the multi-token-prediction layer's tensors are skipped on
  import; bad settings name their key.
"""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from artifacts import make_model, save_model  # noqa: E402

from megatrain_ray.config import ModelConfig  # noqa: E402
from megatrain_ray.errors import ConfigError  # noqa: E402
from megatrain_ray.io import hf_io  # noqa: E402
from megatrain_ray.model import moe  # noqa: E402
from megatrain_ray.model.layout import LayerTemplate  # noqa: E402
from megatrain_ray.model.presets import PRESETS  # noqa: E402
from megatrain_ray.model.transformer import rope_cache, routed_layer, unit_params  # noqa: E402

AIR = {  # zai-org/GLM-4.5-Air's config.json as published (transformers 4.54 wrote it)
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": [151329, 151336, 151338], "first_k_dense_replace": 1, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 10944, "max_position_embeddings": 131072,
    "model_type": "glm4_moe", "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8,
    "num_hidden_layers": 46, "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "pad_token_id": 151329,
    "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
    "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "bfloat16",
    "use_cache": True, "use_qk_norm": False, "vocab_size": 151552}


def _router(n_group=4, topk_group=2, seed=0):
    """transformers' router of a 16-expert GLM layer (top-4, groups, scaling 2.5), randomised, and our config."""
    hf = transformers.Glm4MoeConfig(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
                                    topk_group=topk_group, routed_scaling_factor=2.5, norm_topk_prob=True)
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    torch.manual_seed(seed)
    router = Glm4MoeTopkRouter(hf)
    with torch.no_grad():
        router.weight.normal_(0, 32 ** -0.5)
        router.e_score_correction_bias.normal_(0, 0.1)
    cfg = ModelConfig(model_type="glm4_moe", hidden_size=32, num_attention_heads=4, num_experts=16,
                      num_experts_per_tok=4, moe_intermediate_size=8, n_group=n_group, topk_group=topk_group,
                      routed_scaling_factor=2.5, norm_topk_prob=True)
    cfg.validate()
    n = moe.names(cfg)
    return router, cfg, {n.router: router.weight.detach(), n.score_bias: router.e_score_correction_bias.detach()}


def _by_expert(weights, experts):
    order = experts.argsort(-1)
    return experts.gather(-1, order), weights.gather(-1, order)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_route_chooses_transformers_experts_with_its_weights(dtype):
    router, cfg, p = _router()
    x = torch.randn(256, 32).to(dtype)
    with torch.no_grad():
        _, their_w, their_e = router(x)
    scores, w, e = moe.route(p, x, cfg)
    assert w.dtype == dtype and scores.dtype == torch.float32
    ours, theirs = _by_expert(w.float(), e), _by_expert(their_w.to(dtype).float(), their_e)
    assert torch.equal(ours[0], theirs[0])
    # the same fp32 ops but the k scores' sum in top-k's order (transformers' unsorted): a few fp32 ulps
    # apart, which a bf16 cast may round to neighbouring values (one bf16 ulp, 2^-8 relative)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-6 if dtype == torch.float32 else 2 ** -8, atol=0)
    # A recompute given these experts: the same weights, bit for bit.
    assert torch.equal(moe.route(p, x, cfg, chosen=e)[1], w)
    # The bias and the groups each change some token's choice (so the match above shows both are read).
    unbiased = moe.route({**p, moe.names(cfg).score_bias: torch.zeros(16)}, x, cfg)[2]
    ungrouped = moe.route(p, x, ModelConfig(**{**cfg.__dict__, "n_group": 1, "topk_group": 1}))[2]
    for other in (unbiased, ungrouped):
        assert not torch.equal(other.sort(-1)[0], e.sort(-1)[0])


def test_the_score_correction_bias_gets_no_gradient_and_adamw_leaves_it_bit_for_bit():
    from megatrain_ray.config import OptimConfig
    from megatrain_ray.engine.optim import AdamWRunner, adamw_unit

    model = make_model("glm4_moe")
    cfg = ModelConfig.from_hf_dict(model.config.to_dict())
    p = {n: torch.randn(shape, requires_grad=True) for n, shape in unit_params(cfg, "layers.1")}
    bias = moe.names(cfg).score_bias
    with torch.no_grad():
        p[bias].mul_(0.1)
    x = torch.randn(2, 8, cfg.hidden_size)
    out, _ = routed_layer(p, x, rope_cache(cfg, 8, x.device, torch.float32), cfg)
    out.square().sum().backward()
    assert p[bias].grad is None  # no path: the engine's gradient block keeps its zeros there
    assert p[moe.names(cfg).router].grad.abs().max() > 0

    template = LayerTemplate.build(cfg, "layers.1")
    where = {name: (offset, shape) for name, shape, offset in template.params}
    start, (e,) = where[bias]
    assert start >= template.decay_numel  # a 1-D parameter: decayed only with optim.decay_norms_and_biases
    optim = OptimConfig(lr=1e-2, weight_decay=0.1)
    for runner in (None, AdamWRunner(2)):
        torch.manual_seed(1)
        master = torch.randn(template.numel)
        before = master.clone()
        m, v = torch.zeros_like(master), torch.zeros_like(master)
        for step in range(1, 4):
            grad = torch.randn(template.numel)
            grad[start:start + e] = 0.0
            if runner is None:
                adamw_unit(master, grad, m, v, None, template.decay_numel, step, optim.lr, optim)
            else:
                runner.update(master, grad, m, v, None, template.decay_numel, step, optim.lr, optim)
        assert torch.equal(master[start:start + e], before[start:start + e])
        assert not m[start:start + e].any() and not v[start:start + e].any()
        assert (master[:start] != before[:start]).any()  # the rest did move
        if runner is not None:
            runner.close()

    from megatrain_ray.io.hf_io import load_train_config
    glm = ["model.model_type=glm4_moe", "model.num_experts=4", "model.num_experts_per_tok=2",
           "model.moe_intermediate_size=16"]
    with pytest.raises(ConfigError, match=r"optim\.decay_norms_and_biases cannot be set for a glm4_moe model"):
        load_train_config(None, [*glm, "optim.decay_norms_and_biases=true"])


def test_glm_4_5_air_config_reads_to_the_preset_and_back_in_both_forms():
    preset = ModelConfig(**PRESETS["glm-4.5-air"], max_position_embeddings=131072)
    v5 = transformers.Glm4MoeConfig(**{k: v for k, v in AIR.items() if k != "architectures"}).to_dict()
    assert v5["rope_parameters"]["partial_rotary_factor"] == 0.5 and "partial_rotary_factor" not in v5
    for form in (AIR, v5):
        assert ModelConfig.from_hf_dict(form) == preset
    assert preset.sparse_layers == tuple(range(1, 46)) and preset.rotary_dim == 64 and preset.shared_expert_size == 1408
    written = hf_io.hf_config(preset, torch.bfloat16, dict(AIR))
    back = transformers.Glm4MoeConfig(**{k: v for k, v in written.items() if k != "architectures"})
    for key in ("n_routed_experts", "n_shared_experts", "first_k_dense_replace", "n_group", "topk_group",
                "routed_scaling_factor", "norm_topk_prob", "use_qk_norm", "head_dim", "attention_bias",
                "num_nextn_predict_layers", "moe_intermediate_size"):
        assert getattr(back, key) == AIR[key], key
    assert back.rope_parameters["partial_rotary_factor"] == 0.5 and back.rope_parameters["rope_theta"] == 1e6
    assert written["architectures"] == ["Glm4MoeForCausalLM"]
    assert not any(k in written for k in ("decoder_sparse_step", "mlp_only_layers", "num_experts"))
    # the other families' config.json carry none of GLM's keys
    assert not any(k in ModelConfig(model_type="qwen3").to_hf_dict() for k in ("n_group", "partial_rotary_factor"))


def test_the_multi_token_prediction_layer_is_skipped_on_import(tmp_path):
    from safetensors.torch import save_file

    save_model("glm4_moe", tmp_path / "hf")
    index = json.loads((tmp_path / "hf" / hf_io.INDEX_FILE).read_text())
    mtp = {"model.layers.3.eh_proj.weight": torch.randn(64, 128), "model.layers.3.mlp.gate.weight": torch.randn(8, 64)}
    save_file(mtp, str(tmp_path / "hf" / "mtp.safetensors"), metadata={"format": "pt"})
    index["weight_map"].update({k: "mtp.safetensors" for k in mtp})
    (tmp_path / "hf" / hf_io.INDEX_FILE).write_text(json.dumps(index))
    cfg, raw = hf_io.read_config(str(tmp_path / "hf"))
    assert raw["num_nextn_predict_layers"] == cfg.num_nextn_predict_layers == 1
    hf_io.check_weights(cfg, str(tmp_path / "hf"), "the checkpoint")
    cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0)
    with pytest.raises(ConfigError, match="holds 2 tensor"):
        hf_io.check_weights(cfg, str(tmp_path / "hf"), "the checkpoint")


@pytest.mark.parametrize("change,key", [
    (dict(n_group=3), "model.n_group"),
    (dict(n_group=2, topk_group=3), "model.topk_group"),
    (dict(num_experts_per_tok=4, n_group=4, topk_group=1), "model.topk_group"),
    (dict(routed_scaling_factor=0.0), "model.routed_scaling_factor"),
    (dict(first_k_dense_replace=5), "model.first_k_dense_replace"),
    (dict(output_router_logits=True), "model.output_router_logits"),
    (dict(partial_rotary_factor=0.1), "model.partial_rotary_factor"),
    (dict(decoder_sparse_step=2), "model.decoder_sparse_step"),
    (dict(model_type="qwen3_moe", n_group=2), "model.n_group"),
    (dict(model_type="llama", num_experts=0, num_experts_per_tok=0, partial_rotary_factor=0.5),
     "model.partial_rotary_factor"),
])
def test_bad_glm_settings_name_the_key(change, key):
    base = dict(model_type="glm4_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        ModelConfig(**{**base, **change}).validate()
