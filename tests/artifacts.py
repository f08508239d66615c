"""Tiny real artifacts for the tests: random Hugging Face models of every supported architecture,
and tokenizers trained here; and the tensors of any safetensors directory a run wrote.

Every parameter is randomised (HF initialises norms to one and biases to zero, which would hide a
norm or bias that is loaded into the wrong place), and the model is saved with save_pretrained in
several small shards so import really goes shard by shard.
"""

import glob
import os

import torch
import transformers
from safetensors.torch import load_file

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=128, rms_norm_eps=1e-6)

ARCHS = {
    # Llama 2: multi-head attention, untied head.
    "llama2": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
               dict(num_key_value_heads=4, tie_word_embeddings=False, rope_theta=10000.0)),
    # Llama 3: grouped-query attention, rope_theta 500000, tied head (as Llama 3.2 1B).
    "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
               dict(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=500000.0)),
    # Llama with attention_bias: q/k/v and o_proj biases.
    "llama-bias": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                   dict(num_key_value_heads=2, attention_bias=True)),
    # Qwen2 / 2.5: q/k/v biases, tied head, rope_theta 1e6.
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0)),
    # Qwen3: per-head q/k RMSNorm, head_dim independent of hidden_size / heads.
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=False, rope_theta=1000000.0)),
    # Mistral: grouped-query attention, a sliding window longer than the test sequences.
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(num_key_value_heads=2, sliding_window=4096, rope_theta=10000.0)),
}

MOE_ARCHS = {
    # Qwen3-MoE: q/k norms, softmax top-2 of 4 renormalised; layer 1 dense (mlp_only_layers).
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_hidden_layers=3, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1], rope_theta=1000000.0)),
    # Mixtral: top-2 of 4, every layer sparse, experts intermediate_size wide.
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
    # Qwen2-MoE: q/k/v biases, a shared expert with its sigmoid gate, top-2 of 4 not renormalised,
    # sparse every second layer (decoder_sparse_step=2 of 4 layers: 1 and 3).
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(num_hidden_layers=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=48, decoder_sparse_step=2,
                       tie_word_embeddings=True)),
    # GLM-4.5: sigmoid router with its score-correction bias, 8 experts in 2 groups of which 1 is kept,
    # top-2 renormalised and scaled by 2.5; two ungated shared experts; layer 0 dense
    # (first_k_dense_replace); half of each head rotated, q/k/v biases (no o_proj bias), q/k norms.
    "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM,
                 dict(num_hidden_layers=3, num_key_value_heads=2, head_dim=32, n_routed_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1,
                      n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True,
                      use_qk_norm=True, partial_rotary_factor=0.5, rope_theta=1000000.0)),
}
"""Tiny mixtures of experts, built like :data:`ARCHS` (their routers randomised with std 1/sqrt(H),
so that the routing is decisive and no two experts' scores of a token tie at rounding level; GLM's
score-correction bias, a buffer, with std 0.1, so that it moves some tokens' choice)."""

GPT_OSS_ARCHS = {
    # gpt-oss: biases on q/k/v/o, router and experts; a sink per head; a sliding window of 4 on layer 0
    # (shorter than the test sequences) and full attention on layer 1; YaRN RoPE; the clamped SwiGLU
    # (its limit lowered to 1.5, so that the clamps bind at these scales); top-2 of 4 experts.
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM,
                dict(intermediate_size=32, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                     num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                     swiglu_limit=1.5, rope_parameters={
                         "rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 16, "rope_theta": 150000.0})),
}
"""gpt-oss, tiny (its experts are stacked on the Hub, unlike :data:`MOE_ARCHS`'; its sinks randomised
with std 1, its router like the others')."""

TRANSFORMERS_VERSION = tuple(int(part) for part in transformers.__version__.split(".")[:2])


def dtype_kwarg(dtype) -> dict:
    """from_pretrained's keyword for the dtype to load in: ``dtype`` from transformers 4.56 on,
    ``torch_dtype`` before. ``"auto"`` is config.json's dtype (5's default; 4 loads float32 unless told)."""
    return {"dtype" if TRANSFORMERS_VERSION >= (4, 56) else "torch_dtype": dtype}


def make_model(arch: str, seed: int = 0, **overrides):
    """A tiny random fp32 model of ``arch`` (see ARCHS and MOE_ARCHS)."""
    config_cls, model_cls, extra = {**ARCHS, **MOE_ARCHS, **GPT_OSS_ARCHS}[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**COMMON, **extra, **overrides})).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            elif name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight") \
                    or name.endswith("mlp.router.weight"):
                p.normal_(0, p.shape[-1] ** -0.5)
            elif name.endswith("self_attn.sinks"):
                p.normal_(0, 1.0)
            elif arch in GPT_OSS_ARCHS and name.endswith("experts.gate_up_proj"):
                p.normal_(0, 0.3)  # gates and ups of a few units: the clamped SwiGLU's clamps bind
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return model


def save_model(arch: str, directory, seed: int = 0, shard: str = "40KB", **overrides):
    """Save a tiny random model of ``arch`` in several safetensors shards; returns the model."""
    model = make_model(arch, seed, **overrides)
    model.save_pretrained(directory, max_shard_size=shard)
    return model


def import_store(directory, shm_dir, master_dtype: str = "float32"):
    """A real shared-memory ParameterStore holding the HF checkpoint ``directory`` (fp32 master by
    default; the caller closes it)."""
    from megatrain_ray.config import PrecisionSection
    from megatrain_ray.engine.store.host_store import ParameterStore, StoreSpec
    from megatrain_ray.io import hf_io
    from megatrain_ray.model.precision import resolve_precision

    cfg, _ = hf_io.read_config(str(directory))
    precision = resolve_precision(PrecisionSection(master_dtype=master_dtype), "cpu")
    spec = StoreSpec(cfg, precision, shm_dir, os.getpid(), "t" + os.urandom(3).hex())
    return ParameterStore(spec, seed=0, init_from=str(directory))


def token_ids(vocab: int = 96, batch: int = 2, seq: int = 24, seed: int = 0) -> torch.Tensor:
    """Random token ids [batch, seq] below ``vocab`` (the tiny models' 96 by default), the same for a seed."""
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits [batch, seq, vocab] of ``ids``, without autograd."""
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def imported_logits_match(arch: str, directory, shm_dir):
    """Save a tiny random ``arch`` model to ``directory`` in several shards, import it into a store
    and check that the store's logits equal transformers' (the same fp32 ops on the CPU: 1e-5) for a
    model whose logits are not degenerate. Returns (model, store, ids, transformers' logits); the
    caller closes the store."""
    from megatrain_ray.io.evaluate import forward_logits, store_reader

    model = save_model(arch, directory)
    assert len([n for n in os.listdir(directory) if n.endswith(".safetensors")]) > 2
    store = import_store(directory, shm_dir)
    try:
        assert store.spec.model.model_type == model.config.model_type
        ids = token_ids()
        ours = forward_logits(store.spec.model, store_reader(store.store), ids)
        theirs = hf_logits(model, ids)
        assert ours.shape == theirs.shape == (2, 24, 96)
        assert theirs.std() > 0.1
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    except BaseException:
        store.close()
        raise
    return model, store, ids, theirs


def record_routing(model) -> list:
    """A list that each of ``model``'s GLM routers (transformers' Glm4MoeTopkRouter, whose choice reads
    its score-correction bias and expert groups besides the logits) appends its chosen experts [N, k]
    to at every forward; it stays empty for the other families (see :func:`chosen_experts`)."""
    recorded = []
    for module in model.modules():
        if type(module).__name__ == "Glm4MoeTopkRouter":
            module.register_forward_hook(lambda mod, args, out: recorded.append(out[2].detach()))
    return recorded


def chosen_experts(out, recorded: list, k: int) -> list:
    """The experts [N, k] each sparse layer of a transformers forward (its output ``out``) chose: what
    :func:`record_routing` recorded (emptied here), else the top-k of the softmax of ``out.router_logits``."""
    if recorded:
        chosen = list(recorded)
        recorded.clear()
        return chosen
    return [torch.topk(g.softmax(-1), k, -1)[1] for g in out.router_logits]


def parity_run(tmp_path, shm_dir, steps: int) -> list[str]:
    """The --set overrides the parity tests train with: train.init_from at ``tmp_path/init`` (the
    caller saves the model there), a learnable token stream written here (a fixed cycle with 10%
    noise, below 96), the CPU in fp32, and the optimizer's schedule, clipping and decay."""
    import numpy as np

    rng = np.random.default_rng(1)
    tokens = np.where(rng.random(4000) < 0.1, rng.integers(0, 96, size=4000), (np.arange(4000) * 7) % 96)
    np.save(tmp_path / "tokens.npy", tokens)
    return [f"train.init_from={tmp_path / 'init'}", f"data.path={tmp_path / 'tokens.npy'}",
            f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path / 'runs'}",
            "compute.device=cpu", "precision.compute_dtype=float32", "memory.loss_chunk_size=24", f"train.steps={steps}",
            "optim.lr=1e-2", "optim.min_lr=1e-3", "optim.weight_decay=0.1", "optim.max_grad_norm=0.5", "optim.beta2=0.99"]


def reference_update(opt, params, optim, step: int, steps: int) -> None:
    """The reference's optimizer step as users write it: clip the global norm, set the scheduled lr
    (megatrain_ray.config.lr_at), torch.optim.AdamW's step, zero the gradients."""
    from megatrain_ray.config import lr_at

    torch.nn.utils.clip_grad_norm_(params, optim.max_grad_norm)
    for group in opt.param_groups:
        group["lr"] = lr_at(optim, step, steps)
    opt.step()
    opt.zero_grad()


# ---------------------------------------------------------------------------------------------
# Tokenizers trained here with `tokenizers`, saved as Hugging Face tokenizer directories.

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A ChatML chat template (the Qwen layout), without a default system message."""
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CORPUS = [
    "the engineer streams the weights one layer at a time",
    "a small model learns to count the tokens in order",
    "what is two plus two? it is four.",
    "the optimizer updates the moments after every step",
    "host memory holds the master weights and the optimizer state",
    "please write a short poem about the data loader",
    "sure, here is a poem: tokens flow like water",
]


def save_tokenizer(directory, kind: str = "bpe", vocab_size: int = 200, chat_template: str | None = CHATML):
    """Train a tokenizer on CORPUS and save it with save_pretrained; returns the HF tokenizer.

    kind: "bpe" (SentencePiece-like: Metaspace pre-tokenizer, lossless decoding) or "word" (one id
    per whitespace/punctuation-separated word, so hand-built expectations are easy to write).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS)
    else:
        tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=SPECIALS)
    tok.train_from_iterator(CORPUS * 3 + ["user assistant system", "\n"], trainer)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>",
                                              pad_token="<|endoftext|>")
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(directory)
    return hf


def read_tensors(directory) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``directory`` (a checkpoint's weights and optimizer
    states, an export's weights), by name."""
    out = {}
    for path in sorted(glob.glob(os.path.join(str(directory), "*.safetensors"))):
        out.update(load_file(path))
    return out


def differing(a: dict, b: dict) -> list[str]:
    """The names whose tensors differ between two {name: tensor} dicts (or are missing on one side)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))
