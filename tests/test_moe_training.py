"""Training a mixture of experts through the pipeline, against transformers + torch.optim.AdamW.

Tiny random Qwen3-MoE (dense and sparse layers mixed), Mixtral, Qwen2-MoE (shared expert) and GLM-4.5
(sigmoid router with its score-correction bias and expert groups, shared experts) models,
16 experts each with top-2, few tokens per step, so that in most steps some expert of some layer
receives no token (checked from metrics.jsonl's tokens per expert, which must also equal the
reference's routing): our pipeline (real Ray actors, real shared memory, fp32) and the reference
train from the same checkpoint for several steps with gradient accumulation, clipping, weight
decay and warmup + cosine, the load-balancing loss on (router_aux_loss_coef, per micro-batch, as
transformers adds it with output_router_logits) for two of them. The reference runs in float64 (the
truth) and twice in fp32 (the second with eager attention, transformers' per-expert loop instead of
its grouped GEMM, and the micro-batches reversed); ours'
losses and final weights must be about as close to the truth as the farther fp32 run is
(float64_truth). An expert without a token has a zero gradient there, its moments decay and its
weight decays, in both: an update that skipped it would leave its weights off by lr x its moment.
GLM's score-correction biases, frozen, end bit for bit as they started (weight decay on).
"""

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from artifacts import (chosen_experts, make_model, parity_run, read_tensors, record_routing,  # noqa: E402
                       reference_update)
from float64_truth import assert_as_close_to_truth, float64_only, to_float64  # noqa: E402

from megatrain_ray.data.loader import BatchSource  # noqa: E402
from megatrain_ray.io.hf_io import load_train_config  # noqa: E402
from megatrain_ray.model.moe import names  # noqa: E402
from megatrain_ray.model.transformer import IGNORE_INDEX  # noqa: E402
from megatrain_ray.orchestration.pipeline import train  # noqa: E402

STEPS = 4
SHAPES = {"qwen3_moe": dict(num_experts=16), "mixtral": dict(num_local_experts=16), "qwen2_moe": dict(num_experts=16),
          "glm4_moe": dict(n_routed_experts=16)}


def _model(arch, aux, attention="sdpa", experts="grouped_mm"):
    """The reference model: transformers' own experts kernel (grouped_mm, which it runs on the CPU
    too in fp32) or its per-expert loop (eager, the only one that runs in float64)."""
    model = make_model(arch, **SHAPES[arch], output_router_logits=aux, router_aux_loss_coef=0.05,
                       attn_implementation=attention)
    model.set_experts_implementation(experts)
    return model


def _per_expert(state, cfg):
    """transformers 5's stacked expert parameters split into the Hub's per-expert tensors."""
    out, n, i = {}, names(cfg), cfg.expert_size
    for key, value in state.items():
        if key.endswith("mlp.experts.gate_up_proj") or key.endswith("mlp.experts.down_proj"):
            prefix = key[:key.index("mlp.experts.")]
            for e in range(value.shape[0]):
                gate, up, down = (prefix + s for s in n.expert(e))
                if key.endswith("gate_up_proj"):
                    out[gate], out[up] = value[e, :i], value[e, i:]
                else:
                    out[down] = value[e]
        elif key.endswith("mlp.gate.weight") and cfg.model_type == "mixtral":
            out[key.replace("mlp.gate", "block_sparse_moe.gate")] = value
        else:
            out[key] = value
    return out


def _reference(model, cfg, source, reverse=False):
    """The loop as users write it: per micro-batch CE / step tokens + coef x aux / micro-batches."""
    recorded = record_routing(model)
    params = list(model.parameters())
    o = cfg.optim
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    losses, routed = [], []
    experts = cfg.model.num_experts
    for step in range(cfg.train.steps):
        batch = source.batch(step)
        ids, labels = torch.tensor(batch["input_ids"]), torch.tensor(batch["labels"])
        n_tokens, num_mb = int((labels != IGNORE_INDEX).sum()), ids.shape[0]
        total, counts = 0.0, None
        for m in reversed(range(num_mb)) if reverse else range(num_mb):
            out = model(input_ids=ids[m], output_router_logits=True)
            logits = out.logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[m].reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum") / n_tokens
            if cfg.model.output_router_logits:
                loss = loss + cfg.model.router_aux_loss_coef * out.aux_loss / num_mb
            loss.backward()
            total += loss.item()
            chosen = chosen_experts(out, recorded, cfg.model.num_experts_per_tok)
            mb = torch.stack([torch.bincount(c.reshape(-1), minlength=experts) for c in chosen])
            counts = mb if counts is None else counts + mb
        reference_update(opt, params, o, step, cfg.train.steps)
        losses.append(total)
        routed.append(counts.tolist())
    return losses, _per_expert({k: v.detach().clone() for k, v in model.state_dict().items()}, cfg.model), routed


@pytest.mark.parametrize("arch,aux", [("qwen3_moe", True), ("mixtral", False), ("qwen2_moe", True),
                                      ("glm4_moe", False)])
def test_moe_training_matches_transformers_and_adamw(arch, aux, ray_cluster, shm_dir, tmp_path):
    model = _model(arch, aux)
    model.save_pretrained(tmp_path / "init")
    cfg = load_train_config(None, [*parity_run(tmp_path, shm_dir, STEPS), "train.seq_len=8", "train.micro_batch_size=1",
                                   "train.num_micro_batches=2", "optim.warmup_steps=1"])
    assert cfg.model.model_type == arch and cfg.model.output_router_logits == aux

    result = train(cfg, log=lambda line: None)

    source = BatchSource(cfg.data.path, cfg.train.seq_len, cfg.train.micro_batch_size,
                         cfg.train.num_micro_batches, cfg.train.seed, cfg.model.vocab_size)
    ref_losses, ref_weights, ref_routed = _reference(model, cfg, source)
    alt_losses, alt_weights, _ = _reference(_model(arch, aux, "eager", "eager"), cfg, source, reverse=True)
    exact = to_float64(_model(arch, aux, experts="eager"))
    with float64_only():
        true_losses, true_weights, _ = _reference(exact, cfg, source)

    rows = [json.loads(line) for line in open(tmp_path / "runs" / result.run_id / "metrics.jsonl")]
    routed = [r["expert_tokens"] for r in rows]
    assert routed == ref_routed  # the same routing as transformers', step by step
    idle = [(s, l, e) for s, layers in enumerate(routed) for l, c in enumerate(layers) for e, n in enumerate(c) if n == 0]
    assert idle, "no expert went without a token: the test does not exercise it"
    assert all(r["aux_loss"] > 0 for r in rows) == aux

    assert max(result.grad_norms) > cfg.optim.max_grad_norm  # clipping was active
    steps = [f"loss of step {i}" for i in range(STEPS)]
    assert_as_close_to_truth(dict(zip(steps, result.losses)), [dict(zip(steps, ref_losses)),
                             dict(zip(steps, alt_losses))], dict(zip(steps, true_losses)))

    ours = read_tensors(tmp_path / "runs" / result.run_id / "final")
    tied = cfg.model.tie_word_embeddings
    expected, alt, truth = ({k: v for k, v in w.items() if not (k == "lm_head.weight" and tied)}
                            for w in (ref_weights, alt_weights, true_weights))
    assert set(ours) == set(expected)
    assert_as_close_to_truth(ours, [expected, alt], truth)
    # GLM's score-correction biases are held frozen: bit for bit the initial ones, as transformers' buffers.
    init = read_tensors(tmp_path / "init")
    biases = [k for k in init if k.endswith("e_score_correction_bias")]
    assert bool(biases) == (arch == "glm4_moe")
    assert all(torch.equal(ours[k], init[k]) and torch.equal(ours[k], expected[k]) for k in biases)
