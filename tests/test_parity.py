"""Parity with the trusted reference: HF transformers + torch.optim.AdamW, same batches, fp32 on CPU.

Tiny random Llama (untied) and Qwen2 (q/k/v biases, tied embeddings) models are built locally with
transformers and saved with save_pretrained; both our pipeline (real Ray actors, real shared
memory) and the reference train from that checkpoint for several steps with gradient accumulation,
clipping, weight decay and warmup + cosine. Per-step losses and the final weights must agree.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from megatrain_ray.data.loader import BatchSource  # noqa: E402
from megatrain_ray.config import lr_at  # noqa: E402
from megatrain_ray.io.hf_io import load_train_config  # noqa: E402
from megatrain_ray.model.transformer import IGNORE_INDEX  # noqa: E402
from megatrain_ray.orchestration.pipeline import train  # noqa: E402

STEPS = 5


def _hf_model(kind: str):
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-6)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000000.0)
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # HF zero-inits biases; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    return model.float()


def _reference(model, cfg, source: BatchSource) -> tuple[list[float], dict[str, torch.Tensor]]:
    params = [p for p in model.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    o = cfg.optim
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    losses = []
    for step in range(cfg.train.steps):
        batch = source.batch(step)
        ids, labels = torch.tensor(batch["input_ids"]), torch.tensor(batch["labels"])
        n_tokens = int((labels != IGNORE_INDEX).sum())
        total = 0.0
        for m in range(ids.shape[0]):
            logits = model(input_ids=ids[m]).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[m].reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum") / n_tokens
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, o.max_grad_norm)
        for group in opt.param_groups:
            group["lr"] = lr_at(o, step, cfg.train.steps)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind,micro_batches", [("llama", 2), ("qwen2", 3)])
def test_pipeline_matches_transformers_and_adamw(kind, micro_batches, ray_cluster, shm_dir, tmp_path):
    model = _hf_model(kind)
    model.save_pretrained(tmp_path / "init", safe_serialization=True)
    rng = np.random.default_rng(1)  # a learnable stream: a fixed cycle with 10% noise
    tokens = np.where(rng.random(4000) < 0.1, rng.integers(0, 96, size=4000), (np.arange(4000) * 7) % 96)
    np.save(tmp_path / "tokens.npy", tokens)
    cfg = load_train_config(None, [
        f"runtime.init_from={tmp_path / 'init'}", f"data.path={tmp_path / 'tokens.npy'}",
        f"runtime.shm_dir={shm_dir}", f"runtime.run_dir={tmp_path / 'runs'}",
        "runtime.device=cpu", "runtime.compute_dtype=float32", "runtime.loss_chunk_size=24",
        f"train.steps={STEPS}", "train.seq_len=16", "train.micro_batch_size=2",
        f"train.num_micro_batches={micro_batches}",
        "optim.lr=1e-2", "optim.min_lr=1e-3", "optim.warmup_steps=2", "optim.weight_decay=0.1",
        "optim.max_grad_norm=0.5", "optim.beta2=0.99",
    ])
    assert cfg.model.model_type == kind

    result = train(cfg, log=lambda line: None)

    source = BatchSource(cfg.data.path, cfg.train.seq_len, cfg.train.micro_batch_size,
                         cfg.train.num_micro_batches, cfg.train.seed, cfg.model.vocab_size)
    ref_losses, ref_weights = _reference(model, cfg, source)

    # Clipping was active (else the test would not exercise it) and the loss moved.
    assert max(result.grad_norms) > cfg.optim.max_grad_norm
    assert ref_losses[-1] < ref_losses[0]
    np.testing.assert_allclose(result.losses, ref_losses, rtol=1e-5)

    ours = {}
    import glob
    for path in glob.glob(str(tmp_path / "runs" / result.run_id / "final" / "*.safetensors")):
        ours.update(load_file(path))
    expected = {k: v for k, v in ref_weights.items()
                if not (k == "lm_head.weight" and cfg.model.tie_word_embeddings)}
    assert set(ours) == set(expected)
    diff_sq = sum(float((ours[k] - v).norm() ** 2) for k, v in expected.items())
    ref_sq = sum(float(v.norm() ** 2) for v in expected.values())
    assert (diff_sq / ref_sq) ** 0.5 < 1e-5
    for name, ref in expected.items():
        rel = (ours[name] - ref).norm() / ref.norm()
        # The key bias's gradient is zero in exact arithmetic (softmax ignores a shift shared by
        # all keys of a query), so in both implementations AdamW normalises rounding noise there.
        tol = 1e-4 if name.endswith("k_proj.bias") else 1e-5
        assert rel < tol, f"{name}: relative difference {rel:.2e}"
    # The weights really changed from the initial checkpoint.
    init = _hf_model(kind).state_dict()
    assert (ours["model.layers.0.mlp.up_proj.weight"] - init["model.layers.0.mlp.up_proj.weight"]).norm() > 1e-3

    # Layer-major: each decoder layer is fetched once forward and once backward per step, whatever
    # the number of micro-batches; the embedding once (twice when tied, for the LM head), the head once.
    for fetches in result.fetches:
        assert fetches == {"layers": 2 * cfg.model.num_hidden_layers, "head": 1,
                           "embed": 2 if cfg.model.tie_word_embeddings else 1}
