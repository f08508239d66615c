"""Training gpt-oss through the pipeline, against transformers + torch.optim.AdamW.

A tiny random gpt-oss (:data:`artifacts.GPT_OSS_ARCHS`: a sliding window of 4 on layer 0 over
12-token sequences, sinks, biases on router and experts, the clamped SwiGLU binding, YaRN) with 16
experts top-2, so that some expert of some layer goes without a token in most steps: our pipeline
(real Ray actors, real shared memory, fp32 on the CPU) and the reference train from the same
checkpoint for several steps with gradient accumulation, clipping, weight decay (matrices only: the
biases, including the experts' stacked [E, 2I] ones, the sinks and norms undecayed, as this project
decays), warmup + cosine and the load-balancing loss. The reference runs in float64 (the truth) and
twice in fp32 (transformers' grouped_mm experts; its per-expert loop with the micro-batches
reversed); ours' losses and final weights (written in the Hub's stacked form) must be about as close
to the truth as the farther fp32 run is (float64_truth), the routing equal to transformers' step by
step. The sinks' gradient is part of it: their final values are compared like every other weight.
"""

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from artifacts import make_model, parity_run, read_tensors, reference_update  # noqa: E402
from float64_truth import assert_as_close_to_truth, float64_only, to_float64  # noqa: E402

from megatrain_ray.data.loader import BatchSource  # noqa: E402
from megatrain_ray.io.hf_io import load_train_config  # noqa: E402
from megatrain_ray.model.transformer import IGNORE_INDEX  # noqa: E402
from megatrain_ray.orchestration.pipeline import train  # noqa: E402

STEPS = 4


def _model(experts="grouped_mm"):
    model = make_model("gpt_oss", num_local_experts=16, output_router_logits=True, router_aux_loss_coef=0.05)
    model.set_experts_implementation(experts)
    return model


def _reference(model, cfg, source, reverse=False):
    """The loop as users write it: per micro-batch CE / step tokens + coef x aux / micro-batches."""
    named = list(model.named_parameters())
    params = [p for _, p in named]
    o = cfg.optim
    decayed = [p for n, p in named if p.dim() >= 2 and not n.endswith("bias")]
    groups = [{"params": decayed, "weight_decay": o.weight_decay},
              {"params": [p for p in params if all(p is not q for q in decayed)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    losses, routed = [], []
    for step in range(cfg.train.steps):
        batch = source.batch(step)
        ids, labels = torch.tensor(batch["input_ids"]), torch.tensor(batch["labels"])
        n_tokens, num_mb = int((labels != IGNORE_INDEX).sum()), ids.shape[0]
        total, counts = 0.0, None
        for m in reversed(range(num_mb)) if reverse else range(num_mb):
            out = model(input_ids=ids[m], output_router_logits=True)
            loss = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]).float(), labels[m].reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum") / n_tokens
            loss = loss + cfg.model.router_aux_loss_coef * out.aux_loss / num_mb
            loss.backward()
            total += loss.item()
            chosen = [torch.topk(g, cfg.model.num_experts_per_tok, -1)[1] for g in out.router_logits]
            mb = torch.stack([torch.bincount(c.reshape(-1), minlength=cfg.model.num_experts) for c in chosen])
            counts = mb if counts is None else counts + mb
        reference_update(opt, params, o, step, cfg.train.steps)
        losses.append(total)
        routed.append(counts.tolist())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, routed


def test_gpt_oss_training_matches_transformers_and_adamw(ray_cluster, shm_dir, tmp_path):
    model = _model()
    model.save_pretrained(tmp_path / "init")
    sinks = model.model.layers[0].self_attn.sinks.detach().clone()
    cfg = load_train_config(None, [*parity_run(tmp_path, shm_dir, STEPS), "train.seq_len=12", "train.micro_batch_size=1",
                                   "train.num_micro_batches=2", "optim.warmup_steps=1"])
    assert cfg.model.model_type == "gpt_oss" and cfg.model.window(0) == 4 < cfg.train.seq_len

    result = train(cfg, log=lambda line: None)

    source = BatchSource(cfg.data.path, cfg.train.seq_len, cfg.train.micro_batch_size,
                         cfg.train.num_micro_batches, cfg.train.seed, cfg.model.vocab_size)
    ref_losses, ref_weights, ref_routed = _reference(model, cfg, source)
    alt_losses, alt_weights, _ = _reference(_model("eager"), cfg, source, reverse=True)
    exact = to_float64(_model("eager"))
    with float64_only():
        true_losses, true_weights, _ = _reference(exact, cfg, source)

    rows = [json.loads(line) for line in open(tmp_path / "runs" / result.run_id / "metrics.jsonl")]
    routed = [r["expert_tokens"] for r in rows]
    assert routed == ref_routed
    assert any(n == 0 for layers in routed for c in layers for n in c), "no idle expert: not exercised"
    assert all(r["aux_loss"] > 0 for r in rows)
    assert max(result.grad_norms) > cfg.optim.max_grad_norm  # clipping was active
    steps = [f"loss of step {i}" for i in range(STEPS)]
    assert_as_close_to_truth(dict(zip(steps, result.losses)), [dict(zip(steps, ref_losses)),
                             dict(zip(steps, alt_losses))], dict(zip(steps, true_losses)))

    ours = read_tensors(tmp_path / "runs" / result.run_id / "final")
    assert set(ours) == set(ref_weights)
    assert (ours["model.layers.0.self_attn.sinks"] - sinks).abs().min() > 1e-4  # every head's sink trained
    assert_as_close_to_truth(ours, [ref_weights, alt_weights], true_weights)
