"""The resident reference (benchmarks.reference) against Hugging Face transformers, on the CPU.

The GPU tests and the convergence benchmark trust ResidentModel / ResidentTrainer as the
GPU-resident PyTorch run; here they are checked against HF's own model and torch.optim.AdamW
from the same checkpoint. Both sides run in fp32 on the CPU with the same operations up to
summation order, so they agree to fp32 rounding (~1e-6 relative for a loss after a few steps);
1e-4 leaves a wide margin while any error in the math (a wrong norm, RoPE or group) is far above it.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatrain_ray.data.loader import BatchSource
from megatrain_ray.config import lr_at
from benchmarks.reference import ResidentModel, ResidentTrainer
from megatrain_ray.io.evaluate import checkpoint_reader
from megatrain_ray.io.hf_io import load_train_config
from megatrain_ray.model.transformer import IGNORE_INDEX

transformers = pytest.importorskip("transformers")


def test_resident_trainer_matches_transformers_and_adamw(tmp_path, shm_dir):
    torch.manual_seed(0)
    hf_cfg = transformers.Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True)
    hf = transformers.Qwen2ForCausalLM(hf_cfg).float()
    with torch.no_grad():  # HF zero-inits biases; make them matter
        for layer in hf.model.layers:
            layer.self_attn.q_proj.bias.normal_(0, 0.1)
    hf.save_pretrained(tmp_path / "init", safe_serialization=True)
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 96, size=3000))
    cfg = load_train_config(None, [f"train.init_from={tmp_path / 'init'}", f"data.path={tmp_path / 'tokens.npy'}",
                             f"memory.shm_dir={shm_dir}", "train.steps=3", "train.seq_len=16",
                             "train.micro_batch_size=2", "train.num_micro_batches=2", "optim.lr=1e-2",
                             "optim.weight_decay=0.1", "optim.max_grad_norm=0.5"])
    source = BatchSource(cfg.data.path, cfg.train.seq_len, cfg.train.micro_batch_size,
                         cfg.train.num_micro_batches, cfg.train.seed, cfg.model.vocab_size)

    ours = ResidentTrainer(ResidentModel.from_reader(cfg.model, checkpoint_reader(str(tmp_path / "init"))[1], "cpu"),
                           cfg.optim, cfg.train.steps)
    params = list(hf.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps)
    for step in range(cfg.train.steps):
        batch = source.batch(step)
        loss, norm = ours.step(step, batch)
        ids, labels = torch.tensor(batch["input_ids"]), torch.tensor(batch["labels"])
        n = int((labels != IGNORE_INDEX).sum())
        ref = 0.0
        for m in range(ids.shape[0]):
            logits = hf(input_ids=ids[m]).logits
            part = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[m].reshape(-1), reduction="sum") / n
            part.backward()
            ref += float(part)
        ref_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.optim.max_grad_norm))
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg.optim, step, cfg.train.steps)
        opt.step()
        opt.zero_grad()
        assert loss == pytest.approx(ref, rel=1e-4)
        assert norm == pytest.approx(ref_norm, rel=1e-4)
    assert norm > cfg.optim.max_grad_norm  # clipping was active
    embed = ours.model.units[0]["weight"]
    assert torch.allclose(embed, hf.model.embed_tokens.weight, rtol=0, atol=1e-4 * float(embed.abs().max()))
    ids = torch.tensor(source.batch(0)["input_ids"][0])
    assert ours.model.mean_loss(ids, ids) == pytest.approx(
        float(F.cross_entropy(hf(input_ids=ids).logits.reshape(-1, 96), ids.reshape(-1))), rel=1e-4)
