"""LoRA on mixtures of experts through the real pipeline, against transformers + peft + torch.optim.AdamW.

Tiny random Qwen3-MoE (dense and sparse layers mixed), Mixtral, Qwen2-MoE (a shared expert),
GLM-4.5 (sigmoid router, score-correction bias, expert groups, shared experts) and gpt-oss (biased
router and experts, the clamped SwiGLU; its experts stored de-interleaved here, interleaved in peft)
models, 16 experts each with top-2 and few tokens per step, so that in some step an expert that
was routed before receives no token. Our pipeline (real Ray actors, real shared memory, fp32) trains
adapters on attention, the shared expert and every routed expert (peft's ``target_parameters`` on
``mlp.experts.gate_up_proj`` / ``down_proj``), the router frozen or trained in full (peft's
``modules_to_save``), the load-balancing loss on for two of them; so does the reference: a peft
model whose adapters start from ours, ``torch.optim.AdamW`` and ``clip_grad_norm_`` over what it
trains. The reference also runs in float64 (the truth, transformers' per-expert loop) and once more
in fp32 with eager attention and experts and the micro-batches reversed, and each of those two
again with the head and loss taken over chunks of 3 and of 5 tokens; ours must be about as close to
the truth as the farthest fp32 run (tests/float64_truth.py). The chunked runs are there because
two runs that share transformers' head and loss share much of their rounding: with a clip that
leaves layer 0's MLP gradients near AdamW's eps, the head in chunks of 5 (other GEMM shapes, other
rounding of the same logits) moved layer 0's ``gate_proj.lora_A`` 7x farther from the truth than
the unchunked run, and the farther of ref and alt alone then understates what a valid fp32 run
does by as much.

An idle expert's adapter follows peft + torch: its rows of peft's fused lora_A / lora_B get a zero
gradient, so AdamW decays their moments and weights and moves them by the decayed moments; an
update that skipped them would be off by lr x the moment, orders of magnitude past the band.

The adapter directory loads with ``peft.PeftModel.from_pretrained`` on transformers' model and gives
the merged final/'s logits (loaded with AutoModelForCausalLM); final/ equals peft's own
``merge_and_unload`` of those adapters, and every tensor no adapter touches is bit-identical to the
initial one.

Routing keeps its economies under LoRA: a frozen sparse layer's expert without a token is fetched
once (for the forward), never again for its backward, and no gradient of the frozen base leaves the
device (the engine's counts, as tests/test_moe_streaming.py reads them).
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from artifacts import (chosen_experts, make_model, parity_run, read_tensors, record_routing,  # noqa: E402
                       reference_update)
from float64_truth import assert_as_close_to_truth, float64_only, to_float64  # noqa: E402

from megatrain_ray.data.loader import BatchSource  # noqa: E402
from megatrain_ray.errors import ConfigError  # noqa: E402
from megatrain_ray.io.hf_io import load_train_config  # noqa: E402
from megatrain_ray.io.peft_io import peft_tensors, target_modules, target_parameters  # noqa: E402
from megatrain_ray.model.layout import StoreLayout  # noqa: E402
from megatrain_ray.model.lora import AdapterLayout  # noqa: E402
from megatrain_ray.model.transformer import IGNORE_INDEX  # noqa: E402
from megatrain_ray.orchestration.pipeline import train  # noqa: E402

import torch.nn.functional as F  # noqa: E402

STEPS = 4
SHAPES = {"qwen3_moe": dict(num_experts=16), "mixtral": dict(num_local_experts=16), "qwen2_moe": dict(num_experts=16),
          "glm4_moe": dict(n_routed_experts=16), "gpt_oss": dict(num_local_experts=16)}


def _model(arch, aux, attention="sdpa", experts="grouped_mm"):
    attention = "eager" if arch == "gpt_oss" else attention  # its sinks: no sdpa in transformers
    model = make_model(arch, **SHAPES[arch], output_router_logits=aux, router_aux_loss_coef=0.05,
                       attn_implementation=attention)
    model.set_experts_implementation(experts)
    return model


def _peft(base, cfg, double=False):
    """A peft model on ``base`` with ``cfg.lora``'s adapters, which start from ours (train.seed's draw)."""
    lora = cfg.lora
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, target_modules=target_modules(cfg.model, lora),
        target_parameters=target_parameters(cfg.model, lora) or None,
        modules_to_save=list(lora.modules_to_save) or None))
    layout = AdapterLayout.build(cfg.model, lora)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for unit in layout.units:
            for key, t in peft_tensors(cfg.model, lora, unit, layout.template(unit).bind(layout.init(unit, cfg.train.seed))):
                if ".lora_" in key:  # a router trained in full starts from the base's, as ours
                    params[key.replace(".weight", ".default.weight")].copy_(t)
    return model.double() if double else model


def _reference(model, cfg, source, reverse=False, head_chunk=None):
    """peft training as users write it, the load-balancing loss per micro-batch as transformers adds
    it; returns per-step losses, what trained by its key in peft's adapter file, and the routing.
    With ``head_chunk``, the head and the loss run over that many tokens at a time, as a chunked
    loss does (the same math, rounded through other GEMM shapes)."""
    recorded = record_routing(model)
    trained = {n.replace(".modules_to_save.default.", ".").replace(".default.weight", ".weight"): p
               for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n or n.endswith("mlp.gate.weight") for n in trained)
    o = cfg.optim
    opt = torch.optim.AdamW(list(trained.values()), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay)
    losses, routed = [], []
    for step in range(cfg.train.steps):
        batch = source.batch(step)
        ids, labels = torch.tensor(batch["input_ids"]), torch.tensor(batch["labels"])
        n_tokens, num_mb = int((labels != IGNORE_INDEX).sum()), ids.shape[0]
        total, counts = 0.0, None
        for m in reversed(range(num_mb)) if reverse else range(num_mb):
            out = model(input_ids=ids[m], output_router_logits=True, output_hidden_states=head_chunk is not None)
            loss = _token_loss(model, out, labels[m].reshape(-1), head_chunk) / n_tokens
            if cfg.model.output_router_logits:
                loss = loss + cfg.model.router_aux_loss_coef * out.aux_loss / num_mb
            loss.backward()
            total += loss.item()
            chosen = chosen_experts(out, recorded, cfg.model.num_experts_per_tok)
            mb = torch.stack([torch.bincount(c.reshape(-1), minlength=cfg.model.num_experts) for c in chosen])
            counts = mb if counts is None else counts + mb
        reference_update(opt, list(trained.values()), o, step, cfg.train.steps)
        losses.append(total)
        routed.append(counts.tolist())
    return losses, {n: p.detach().clone() for n, p in trained.items()}, routed


def _token_loss(model, out, labels, head_chunk):
    """The summed cross-entropy of one micro-batch: of ``out.logits``, or with ``head_chunk`` of the
    head applied to the final (normed) hidden states that many tokens at a time. labels: [S]."""
    if head_chunk is None:
        return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]).float(), labels,
                               ignore_index=IGNORE_INDEX, reduction="sum")
    h = out.hidden_states[-1].reshape(labels.shape[0], -1)
    head = model.get_output_embeddings()
    return sum(F.cross_entropy(head(h[i:i + head_chunk]).float(), labels[i:i + head_chunk],
                               ignore_index=IGNORE_INDEX, reduction="sum") for i in range(0, len(labels), head_chunk))


@pytest.mark.parametrize("arch,aux,lora", [
    ("qwen3_moe", True, ["lora.target_modules=q_proj,v_proj,o_proj"]),
    ("mixtral", False, ["lora.target_modules=q_proj,k_proj", "lora.target_experts=down_proj", "lora.train_router=true"]),
    ("qwen2_moe", True, ["lora.target_modules=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                         "lora.train_router=true"]),
    # two compute workers (data parallel, gloo), each routing its own micro-batches, the adapters' gradients summed
    ("qwen2_moe", False, ["lora.target_modules=q_proj,v_proj,down_proj", "parallel.compute_workers=2",
                          "train.num_micro_batches=4"]),
    # GLM-4.5: the router trained in full beside its frozen score-correction bias, which stays bit for bit
    ("glm4_moe", False, ["lora.target_modules=q_proj,k_proj,v_proj,o_proj", "lora.train_router=true"]),
    # gpt-oss: biased router and experts, the clamped SwiGLU, sinks and a window; its experts stored
    # de-interleaved here, exported interleaved as transformers' gate_up_proj
    ("gpt_oss", True, ["lora.target_modules=q_proj,k_proj,v_proj,o_proj"]),
], ids=["qwen3_moe", "mixtral-router", "qwen2_moe-router", "qwen2_moe-two-workers", "glm4_moe-router", "gpt_oss"])
def test_moe_lora_training_matches_peft_and_adamw(arch, aux, lora, ray_cluster, shm_dir, tmp_path):
    _model(arch, aux).save_pretrained(tmp_path / "init")
    cfg = load_train_config(None, [*parity_run(tmp_path, shm_dir, STEPS), "train.seq_len=8", "train.micro_batch_size=1",
                                   "train.num_micro_batches=2", "optim.warmup_steps=1", "optim.lr=2e-2",
                                   "optim.max_grad_norm=0.05", "lora.rank=4", "lora.alpha=8", *lora])
    assert cfg.model.model_type == arch and cfg.model.sparse_layers
    result = train(cfg, log=lambda line: None)
    run = tmp_path / "runs" / result.run_id

    source = BatchSource(cfg.data.path, cfg.train.seq_len, cfg.train.micro_batch_size,
                         cfg.train.num_micro_batches, cfg.train.seed, cfg.model.vocab_size)
    ref_losses, ref, ref_routed = _reference(_peft(_model(arch, aux), cfg), cfg, source)
    alt_losses, alt, _ = _reference(_peft(_model(arch, aux, "eager", "eager"), cfg), cfg, source, reverse=True)
    chunked = [_reference(_peft(_model(arch, aux, *kernels), cfg), cfg, source, reverse=reverse, head_chunk=c)
               for c in (3, 5) for kernels, reverse in ((("sdpa", "grouped_mm"), False), (("eager", "eager"), True))]
    exact = _peft(to_float64(_model(arch, aux, experts="eager")), cfg, double=True)
    with float64_only():
        true_losses, truth, _ = _reference(exact, cfg, source)

    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    routed = [r["expert_tokens"] for r in rows]
    assert routed == ref_routed  # the same routing as transformers', step by step
    # an expert routed in an earlier step and idle in a later one: its adapter moves by its decayed moments
    assert any(n == 0 and any(routed[t][layer][e] for t in range(step))
               for step in range(1, STEPS) for layer in range(len(routed[step]))
               for e, n in enumerate(routed[step][layer])), "no routed expert went idle: the test does not exercise it"
    assert max(result.grad_norms) > cfg.optim.max_grad_norm  # clipping was active
    steps = [f"loss of step {i}" for i in range(STEPS)]
    assert_as_close_to_truth(dict(zip(steps, result.losses)), [dict(zip(steps, losses)) for losses in
                             (ref_losses, alt_losses, *(c[0] for c in chunked))], dict(zip(steps, true_losses)))

    from safetensors.torch import load_file
    ours = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    # PEFT saves a router trained in full as its whole module: GLM's frozen score-correction bias with it
    biases = {k: ours.pop(k) for k in [k for k in ours if k.endswith("e_score_correction_bias")]}
    assert bool(biases) == (arch == "glm4_moe" and cfg.lora.train_router)
    init = read_tensors(tmp_path / "init")
    assert all(torch.equal(v, init[k.removeprefix("base_model.model.")]) for k, v in biases.items())
    assert set(ours) == set(ref)
    assert any(".experts." in k for k in ours) and (("mlp.gate.weight" in " ".join(ours)) == cfg.lora.train_router)
    assert_as_close_to_truth(ours, [ref, alt, *(c[1] for c in chunked)], truth)
    assert all(v.abs().max() > 1e-3 for k, v in ours.items() if k.endswith("experts.lora_B.weight"))  # they trained

    # peft loads the adapters on transformers' model, and gives the merged final/'s logits.
    loaded = peft.PeftModel.from_pretrained(_model(arch, aux), str(run / "adapter")).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(run / "final")).eval()
    ids = torch.tensor(source.batch(0)["input_ids"][0])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, merged(input_ids=ids).logits.float(),
                                   rtol=1e-5, atol=1e-5)
    # final/ is peft's own merge of those adapters; what no adapter touches is the initial base bit for bit.
    theirs = {k: v for k, v in loaded.merge_and_unload().state_dict().items()}
    init, final = read_tensors(tmp_path / "init"), read_tensors(run / "final")
    assert set(final) == set(init)
    stacked = merged.state_dict()  # transformers' names (experts stacked), as peft's merge names them
    assert set(stacked) == set(theirs)
    for key in stacked:
        torch.testing.assert_close(stacked[key], theirs[key], rtol=1e-6, atol=1e-6)
    untouched = [k for k in final if not any(f".{m}." in k for m in cfg.lora.target_modules)
                 and ".experts." not in k and not (cfg.lora.train_router and k.endswith("gate.weight")
                                                   and "shared_expert" not in k)]
    assert untouched and all(torch.equal(final[k], init[k]) for k in untouched)


def test_idle_experts_are_not_fetched_again_under_lora(ray_cluster, shm_dir, tmp_path):
    """A LoRA run of a tiny Qwen2-MoE with 16 experts: per step, sparse layer and expert, an expert
    without a token was fetched once (the forward) and never for its backward, one with tokens once
    more; no gradient bytes of any expert, and no byte of gradient to the host at all (the base is
    frozen; the adapters live on the device)."""
    make_model("qwen2_moe", num_experts=16).save_pretrained(tmp_path / "init")
    cfg = load_train_config(None, [*parity_run(tmp_path, shm_dir, 2), "train.seq_len=8", "train.micro_batch_size=1",
                                   "train.num_micro_batches=2", "lora.rank=4"])
    result = train(cfg, log=lambda line: None)
    rows = [json.loads(line) for line in open(tmp_path / "runs" / result.run_id / "metrics.jsonl")]
    sparse = [u for u in StoreLayout.build(cfg.model).layers if u.parts]
    idle_seen = 0
    for row in rows:
        assert len(row["expert_tokens"]) == len(row["expert_refetches"]) == len(sparse)
        for tokens, refetches, sent in zip(row["expert_tokens"], row["expert_refetches"], row["expert_grad_bytes"]):
            assert refetches == [1 if n else 0 for n in tokens]
            assert sent == [0] * len(tokens)
            idle_seen += tokens.count(0)
        assert row["d2h_bytes"] == 0
    assert idle_seen, "no expert went without a token: the test does not exercise it"


def test_moe_lora_config_errors(tmp_path):
    """What a LoRA run of a mixture of experts refuses, each naming its key."""
    moe = ["model.model_type=qwen3_moe", "model.num_experts=4", "model.num_experts_per_tok=2", "model.moe_intermediate_size=16", "lora.rank=4"]
    with pytest.raises(ConfigError, match="lora.dropout must be 0 on a mixture of experts"):
        load_train_config(None, [*moe, "lora.dropout=0.1"])
    with pytest.raises(ConfigError, match="lora.target_experts names 'gate_proj'"):
        load_train_config(None, [*moe, "lora.target_experts=gate_proj"])
    with pytest.raises(ConfigError, match="lora.train_router needs a mixture of experts"):
        load_train_config(None, ["lora.rank=4", "lora.train_router=true"])
    with pytest.raises(ConfigError, match="lora.train_router needs lora.rank > 0"):
        load_train_config(None, [*moe[:-1], "lora.train_router=true"])
    with pytest.raises(ConfigError, match="lora.target_modules names down_proj, which on a qwen3_moe model PEFT reads"):
        load_train_config(None, [*moe, "model.num_hidden_layers=2", "model.mlp_only_layers=[1]",
                                 "lora.target_modules=q_proj,down_proj"])
    glm = ["model.model_type=glm4_moe", "model.num_experts=4", "model.num_experts_per_tok=2",
           "model.moe_intermediate_size=16", "model.n_shared_experts=1", "lora.rank=4"]
    with pytest.raises(ConfigError, match="lora.target_modules names gate_proj, which on a glm4_moe model PEFT reads "
                                          "as its routed experts' parameters, so the adapters of its shared experts"):
        load_train_config(None, [*glm, "lora.target_modules=q_proj,gate_proj"])
    oss = ["model.model_type=gpt_oss", "model.num_experts=4", "model.num_experts_per_tok=2", "model.num_hidden_layers=2",
           "model.sliding_window=8", "model.layer_types=[sliding_attention,full_attention]", "lora.rank=4"]
    assert load_train_config(None, oss).lora.target_experts == ("gate_up_proj", "down_proj")  # adapters on its experts
    with pytest.raises(ConfigError, match="lora.train_router must be false on a gpt_oss model"):
        load_train_config(None, [*oss, "lora.train_router=true"])
    cfg = load_train_config(None, [*moe, "lora.target_experts=[]"])
    assert cfg.lora.target_experts == () and not any(".experts." in n for t in
                                                      AdapterLayout.build(cfg.model, cfg.lora).templates
                                                      for n, _, _ in t.params)


def _sparse_cfg(rank_experts=16, **kw):
    from megatrain_ray.config import ModelConfig
    cfg = ModelConfig(model_type="qwen3_moe", num_experts=16, num_experts_per_tok=2, moe_intermediate_size=kw.get("i", 32),
                      hidden_size=kw.get("h", 64), num_attention_heads=4, num_hidden_layers=1)
    cfg.validate()
    return cfg


def _expert_params(cfg, rank, device, dtype):
    """A sparse layer's MLP weights and random adapters on both stacked expert parameters (B nonzero)."""
    from megatrain_ray.model import moe as M
    torch.manual_seed(0)
    ref = {n: torch.randn(shape) * shape[-1] ** -0.5 for n, shape in M.sparse_params(cfg)}
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.expert_size
    gate_up, down = M.names(cfg).stacked
    for name, (rows, cols) in ((gate_up, (2 * i, h)), (down, (h, i))):
        ref[f"{name}.lora_A.weight"] = torch.randn(e, rank, cols) * cols ** -0.5
        ref[f"{name}.lora_B.weight"] = torch.randn(e, rows, rank) * rank ** -0.5
    p = {n: v.to(device, dtype).requires_grad_(True) for n, v in ref.items()}
    for name in (gate_up, down):
        p[f"{name}.lora_scaling"] = torch.tensor(0.5)
    return p


def test_expert_adapters_add_peft_delta_per_expert_and_idle_ones_get_zero_gradient():
    """The routed experts with adapters compute, per expert, what PEFT's ParamWrapper does: the base
    stacked weights plus scaling * B_e A_e (formed here in float64, one matmul per expert) — the
    adapters through grouped GEMMs of rank r without forming it; an expert without a token gets an
    exactly zero gradient on its A_e and B_e."""
    from megatrain_ray.model import moe as M
    cfg = _sparse_cfg()
    p = _expert_params(cfg, 4, "cpu", torch.float64)
    x = torch.randn(6, cfg.hidden_size, dtype=torch.float64)  # 6 tokens x top-2 of 16: idle experts
    _, weights, experts = M.route(p, x, cfg)
    out, counts = M.routed_experts(p, x, weights, experts, cfg)
    gate_up, down = M.names(cfg).stacked
    merged = dict(p)
    for name in (gate_up, down):
        a, b = p[f"{name}.lora_A.weight"], p[f"{name}.lora_B.weight"]
        merged[name] = M.expert_weights(p, cfg)[name == down] + 0.5 * torch.bmm(b, a)
    merged = {k: v for k, v in merged.items() if ".lora_" not in k}
    for e in range(cfg.num_experts):  # the per-expert tensors replaced by the merged stacked ones
        for n in M.names(cfg).expert(e):
            merged.pop(n)
    theirs, _ = M.routed_experts(merged, x, weights, experts, cfg)
    torch.testing.assert_close(out, theirs, rtol=1e-12, atol=1e-12)
    out.square().sum().backward()
    idle = (counts == 0).nonzero().flatten().tolist()
    assert idle and (counts > 0).any()
    for name in (gate_up, down):
        for kind in ("A", "B"):
            g = p[f"{name}.lora_{kind}.weight"].grad
            assert torch.count_nonzero(g[idle]) == 0 and all(g[e].abs().max() > 0 for e in range(16) if counts[e])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_gpu_grouped_expert_adapters_match_the_per_expert_path():
    """On a GPU in bf16, rank 16: the adapters run as grouped GEMMs (no loop over experts); the same
    routing through the per-expert path on the CPU in fp32 gives the same output and adapter gradients
    within bf16 rounding, an idle expert's exactly zero in both."""
    from megatrain_ray.model import grouped
    from megatrain_ray.model import moe as M
    cfg = _sparse_cfg(h=256, i=128)
    x = torch.randn(6, 256)
    outs = {}
    for device, dtype in (("cuda", torch.bfloat16), ("cpu", torch.float32)):
        p = _expert_params(cfg, 16, device, dtype)
        if device == "cpu":
            _, weights, experts = M.route({k: v.detach() for k, v in p.items()}, x, cfg)
        xi = x.to(device, dtype)
        for name in M.names(cfg).stacked:
            assert grouped.grouped_kernel(xi, p[f"{name}.lora_A.weight"]) == (device == "cuda")
        outs[device] = p, xi
    grads = {}
    for device, (p, xi) in outs.items():
        out, counts = M.routed_experts(p, xi, weights.to(device, xi.dtype), experts.to(device), cfg)
        out.float().square().sum().backward()
        grads[device] = (out.float().cpu(), {n: v.grad.float().cpu() for n, v in p.items() if ".lora_" in n
                                             and v.grad is not None}, counts.cpu())
    (a, ga, ca), (b, gb, cb) = grads["cuda"], grads["cpu"]
    assert torch.equal(ca, cb) and set(ga) == set(gb) and len(ga) == 4
    torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)
    idle = (cb == 0).nonzero().flatten().tolist()
    for name in ga:
        assert torch.count_nonzero(ga[name][idle]) == torch.count_nonzero(gb[name][idle]) == 0
        torch.testing.assert_close(ga[name], gb[name], rtol=5e-2, atol=5e-2 * gb[name].abs().max().item())


def test_lora_flops_count_the_routed_experts_adapters_at_top_k():
    from megatrain_ray.config import LoraSection
    from megatrain_ray.model import flops
    from megatrain_ray.model.presets import preset_model
    cfg = preset_model("qwen3-30b-a3b", 2)
    lora = LoraSection(rank=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    layout = AdapterLayout.build(cfg, lora)
    h, i, e, k, r = cfg.hidden_size, cfg.expert_size, cfg.num_experts, cfg.num_experts_per_tok, 16
    experts = e * r * (h + 2 * i) + e * r * (i + h)  # gate_up: A [E, r, H], B [E, 2I, r]; down: A [E, r, I], B [E, H, r]
    q, kv = cfg.num_attention_heads * cfg.head_size, cfg.num_key_value_heads * cfg.head_size
    attention = r * (h + q) + 2 * r * (h + kv) + r * (q + h)  # q, k, v: A [r, H], B [out, r]; o: [r, q], [H, r]
    assert layout.num_params == 2 * (attention + experts)
    assert layout.active_params(cfg) == 2 * (attention + experts * k // e)
    six, _ = flops.lora_flops(cfg, lora, 1024, 1000)
    assert six == (4.0 * flops.active_params(cfg) + 6.0 * layout.active_params(cfg)) * 1000


PLACEMENTS = {"keep": ((), ("keep",) * 3), "recompute": ((), ("gpu",) * 3),
              "counts": (("memory.spanned_layers=2",), ("gpu", "span", "span"))}


def test_moe_lora_trains_alike_kept_recomputed_or_in_a_span(ray_cluster, shm_dir, tmp_path):
    """A Qwen3-MoE (dense and sparse layers, the load-balancing loss on) with adapters on attention
    and the experts and its routers trained: every layer kept whole (engine.compute.passes.KeptSparse), every
    layer recomputed (RecomputedSparse), and every layer but the first in a recompute span (its forward run
    again from weights fetched without the idle experts): the same losses and adapters bit for bit."""
    from safetensors.torch import load_file

    from megatrain_ray.orchestration.device_memory import activation_placement

    make_model("qwen3_moe", num_experts=16, output_router_logits=True, router_aux_loss_coef=0.05).save_pretrained(
        tmp_path / "init")
    results = {}
    for placement, (extra, modes) in PLACEMENTS.items():
        cfg = load_train_config(None, [*parity_run(tmp_path, shm_dir, 2), "train.seq_len=8", "train.micro_batch_size=1",
                                       "train.num_micro_batches=2", f"memory.activations={placement}", *extra,
                                       f"train.run_dir={tmp_path / placement}", "lora.rank=4",
                                       "lora.target_modules=q_proj,o_proj", "lora.train_router=true"])
        assert activation_placement(cfg, "cpu", None) == modes
        result = train(cfg, log=lambda line: None)
        rows = [json.loads(line) for line in open(tmp_path / placement / result.run_id / "metrics.jsonl")]
        results[placement] = (result.losses, [r["expert_tokens"] for r in rows],
                              load_file(str(tmp_path / placement / result.run_id / "adapter" / "adapter_model.safetensors")))
    losses, routed, adapters = results["recompute"]
    assert any(n == 0 for step in routed for layer in step for n in layer)
    assert any(k.endswith("mlp.gate.weight") for k in adapters) and any(".experts." in k for k in adapters)
    for placement in ("keep", "counts"):
        got_losses, got_routed, got = results[placement]
        assert got_losses == losses and got_routed == routed, placement
        assert set(got) == set(adapters) and all(torch.equal(got[k], adapters[k]) for k in adapters), placement


def test_moe_lora_resumes_bit_for_bit(ray_cluster, shm_dir, tmp_path):
    """A LoRA checkpoint of a mixture of experts holds the experts' stacked adapters, the trained
    routers and their moments; a run resumed from it ends bit for bit as the run straight through."""
    import os

    from safetensors.torch import load_file

    from megatrain_ray.io import checkpoint

    make_model("mixtral", num_local_experts=16).save_pretrained(tmp_path / "init")

    def config(run: str):
        return load_train_config(None, [*parity_run(tmp_path, shm_dir, 4), "train.seq_len=8", "train.micro_batch_size=1",
                                        "train.num_micro_batches=2", f"train.run_dir={tmp_path / run}",
                                        "train.checkpoint_every=2", "train.keep_checkpoints=5", "lora.rank=4",
                                        "lora.target_modules=q_proj,o_proj", "lora.train_router=true"])

    straight = train(config("a"), log=lambda line: None)
    step2 = sorted(checkpoint.step_dirs(os.path.join(straight.run_dir, "checkpoints")))[0][1]
    held = read_tensors(step2)
    assert any(k.startswith("exp_avg.") and "experts.gate_up_proj.lora_B" in k for k in held)
    assert any(k.startswith("exp_avg_sq.") and k.endswith("block_sparse_moe.gate.weight") for k in held)
    resumed = train(config("b"), log=lambda line: None, resume=step2)
    assert resumed.losses == straight.losses[2:] and resumed.grad_norms == straight.grad_norms[2:]
    ours, theirs = (load_file(os.path.join(r.run_dir, "adapter", "adapter_model.safetensors")) for r in (resumed, straight))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_gpt_oss_expert_adapters_export_loads_in_peft_and_merged(tmp_path):
    """gpt-oss with adapters on attention and both stacked expert parameters (B random, so they
    matter): the adapter directory loads with ``PeftModel.from_pretrained`` on transformers'
    GptOssForCausalLM (its gate_up_proj's lora_B rows interleaved gate/up as that parameter's
    columns are, transposed experts: in = H, out = 2I) and gives our logits; the merged export, the
    Hub's stacked form, loads with AutoModelForCausalLM and gives them too, equals peft's own
    ``merge_and_unload`` and keeps the experts' biases bit for bit."""
    from megatrain_ray.config import LoraSection
    from megatrain_ray.io import hf_io, peft_io
    from megatrain_ray.io.evaluate import forward_logits
    from megatrain_ray.model.layout import LayerTemplate

    from artifacts import hf_logits, token_ids

    base = make_model("gpt_oss")
    base.save_pretrained(tmp_path / "base")
    cfg = hf_io.read_config(str(tmp_path / "base"))[0]
    lora = LoraSection(rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    layout = AdapterLayout.build(cfg, lora)
    adapters, g = {}, torch.Generator().manual_seed(5)
    for unit in layout.units:
        adapters[unit] = layout.init(unit, seed=0)
        for name, view in layout.template(unit).bind(adapters[unit]).items():
            if ".lora_B." in name:
                view.normal_(0, 0.2, generator=g)
    assert any(".experts.gate_up_proj.lora_B" in n for t in layout.templates for n, _, _ in t.params)
    peft_io.save_adapters(str(tmp_path / "adapter"), cfg, lora, adapters, base_model=str(tmp_path / "base"))
    mapping = hf_io.check_weights(cfg, str(tmp_path / "base"), "the test model")

    def reader(adapters):  # our units: base weights in a flat buffer (stacked expert views), adapters beside
        def read(unit):
            template = LayerTemplate.build(cfg, unit)
            flat = torch.zeros(template.numel)
            for name, t in hf_io.read_unit(str(tmp_path / "base"), mapping, cfg, unit).items():
                template.bind(flat)[name].copy_(t)
            params = template.bind(flat, fused=True)
            return {**params, **layout.bind(unit, adapters[unit])} if unit in layout.units else params
        return read

    ids = token_ids()
    ours = forward_logits(cfg, reader(adapters), ids)
    loaded = peft.PeftModel.from_pretrained(make_model("gpt_oss"), str(tmp_path / "adapter")).eval()
    assert {n for n, _ in loaded.named_parameters() if "lora_" in n} and all(
        p.abs().max() > 0 for n, p in loaded.named_parameters() if "experts" in n and "lora_B" in n)
    theirs = hf_logits(loaded, ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)  # the same fp32 ops, summed in other orders
    assert (theirs - hf_logits(base, ids)).abs().max() > 1e-2  # the adapters matter, the experts' too
    plain = {unit: flat.clone() for unit, flat in adapters.items()}
    for unit in layout.units:  # without the experts' adapters the logits move: peft read them
        for name, view in layout.template(unit).bind(plain[unit]).items():
            if ".experts." in name and ".lora_B." in name:
                view.zero_()
    assert (forward_logits(cfg, reader(plain), ids) - theirs).abs().max() > 1e-3

    peft_io.save_merged(str(tmp_path / "merged"), cfg, lora, adapters,
                        lambda unit, name: hf_io.read_unit(str(tmp_path / "base"), mapping, cfg, unit)[name],
                        torch.float32, source=str(tmp_path / "base"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).float().eval()
    torch.testing.assert_close(hf_logits(merged, ids), theirs, rtol=1e-5, atol=1e-5)
    written, init = read_tensors(tmp_path / "merged"), read_tensors(tmp_path / "base")
    assert set(written) == set(init) and any(".experts.gate_up_proj" in k for k in written)
    reference = loaded.merge_and_unload().state_dict()
    for key, value in written.items():
        torch.testing.assert_close(value, reference[key], rtol=1e-6, atol=1e-6)
        if key.endswith("bias") or not any(m in key for m in (*lora.target_modules, "experts.gate_up", "experts.down")):
            assert torch.equal(value, init[key]), key
        else:
            assert not torch.equal(value, init[key]), key
