"""The model: a decoder-only transformer (Llama / Qwen2 / Qwen3 / Mistral, and the mixtures of
experts Qwen3-MoE / Mixtral / Qwen2-MoE / GLM-4.5 / gpt-oss), architecture only.

Everything here is a pure function of (weights, inputs). Weights arrive as a dict of tensors keyed
by their Hugging Face names relative to the unit (``self_attn.q_proj.weight``, ...): any tensors,
views into a streamed flat buffer or not. Nothing here knows about storage, streaming, offload,
devices or Ray.

Grouped projections, the one place where how weights are passed can change how the math is run:
q/k/v read the same input, and so do gate/up (:data:`PROJECTION_GROUPS`). :func:`project` computes a
group's outputs with one GEMM when the params also carry the group's *concatenated* weight under the
group's name (``self_attn.qkv_proj.weight`` = the q, k and v weights stacked along dim 0; biases
likewise), else with one GEMM per member. The two give the same values; the concatenation is an
optimisation offered by the caller, never required, and the model neither builds nor stores it. The
engine offers it for free, as a zero-copy view, because the flat layout puts each group's members
back to back (:meth:`megatrain_ray.model.layout.LayerTemplate.bind` with ``fused=True``); a gradient
taken through that view lands in the members' places. Chosen over a fused-weight storage format (the
checkpoint and the optimizer keep HF's separate tensors) and over a strategy object threaded through
every call (the params are already the one thing the caller hands in).

Low-rank adapters (LoRA) are offered the same way: where the params also hold an adapter for a
projection (``self_attn.q_proj.lora_A.weight`` [r, in], ``...lora_B.weight`` [out, r] and
``...lora_scaling``, PEFT's names), :func:`linear` adds its term, scaling * B (A x), to the
projection's output, as PEFT's LoRA layer does; with ``...lora_dropout`` too (a [B, S, in] tensor of
0 and 1 / (1 - p), the dropout of the adapter's input), the term is scaling * B (A (x * mask)). The
model neither creates nor stores adapters or masks; the caller binds them next to the base weights
(:mod:`megatrain_ray.model.lora`). :func:`~megatrain_ray.model.linear.linear` is that one linear helper
(the shared expert of a sparse layer uses it too); the routed experts' adapters are added inside
their grouped GEMMs (:func:`megatrain_ray.model.moe.routed_experts`).

Packed documents: a sequence may hold several documents, each starting at position 0. The caller
then passes RoPE tables gathered at each token's position within its document (:func:`rope_at`,
[B, S, d] instead of [S, d]) and an attention mask that lets a token see only the earlier tokens of
its own document: a dense boolean [B, 1, S, S] (:func:`document_mask`, SDPA with an explicit mask)
or a FlexAttention ``BlockMask`` built from the same rule (the fast path on a GPU, built by the
engine); ``mask=None`` is plain causal attention over the whole sequence.

Sliding-window layers and attention sinks (gpt-oss): a layer whose ``cfg.window(i)`` is set takes a
mask limited to that window (:func:`layer_mask`; the caller hands each layer its own, as transformers
does), and a layer whose params hold ``self_attn.sinks`` [heads] runs
:mod:`megatrain_ray.model.sink_attention` (each head's learned sink logit in the softmax).

:func:`decoder_layer` is :func:`attention_block` then :func:`mlp_block`; the second is
position-wise, so a caller may run it over pieces of the sequence (same values). :func:`mlp_block`
is h + down_proj(:func:`mlp_activation`), so a caller may stop before the layer's last GEMM (a
backward needs its input, not its output).

Dense and sparse layers: a layer's MLP is the dense SwiGLU MLP or, in a sparse layer of a mixture
of experts (``cfg.is_sparse(i)``), :func:`megatrain_ray.model.moe.sparse_mlp`; :func:`unit_params`
describes each layer's tensors accordingly, and :func:`mlp_block` runs the MLP its params describe
(a router's weight among them: sparse), so the same :func:`decoder_layer` runs both kinds.
:func:`routed_layer` is the sparse layer with its router's statistics for the load-balancing loss.

The model is split into *units*, the granularity at which weights are stored and streamed:
``embed`` (token embeddings), ``layers.{i}`` (one decoder layer each) and ``head`` (final norm and,
unless tied, the LM head). :func:`unit_params` lists each unit's parameters and shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from ..config import ModelConfig
from .linear import add_low_rank, linear, low_rank
from .moe import RouterStats, is_sparse, sparse_mlp, sparse_params
from .sink_attention import flex_sink_attention, sink_attention, window_mask
from .yarn import yarn_frequencies

Params = dict[str, torch.Tensor]
UnitReader = Callable[[str], Params]
"""unit name (embed, layers.i, head) -> its parameters, named relative to the unit."""

IGNORE_INDEX = -100
"""Label value whose position does not count in the loss (padding, prompt tokens)."""


def unit_names(cfg: ModelConfig) -> list[str]:
    """All units in forward order."""
    return ["embed", *(f"layers.{i}" for i in range(cfg.num_hidden_layers)), "head"]


def unit_params(cfg: ModelConfig, unit: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name relative to the unit, shape) of each parameter of one unit, in HF naming."""
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_size
    if unit == "embed":
        return [("weight", (cfg.vocab_size, h))]
    if unit == "head":
        params = [("norm.weight", (h,))]
        if not cfg.tie_word_embeddings:
            params.append(("lm_head.weight", (cfg.vocab_size, h)))
        return params
    q = cfg.num_attention_heads * cfg.head_size
    if cfg.is_sparse(int(unit.split(".")[1])):
        mlp = sparse_params(cfg)
    else:
        mlp = [("mlp.gate_proj.weight", (cfg.intermediate_size, h)), ("mlp.up_proj.weight", (cfg.intermediate_size, h)),
               ("mlp.down_proj.weight", (h, cfg.intermediate_size))]
    params = [
        ("self_attn.q_proj.weight", (q, h)),
        ("self_attn.k_proj.weight", (kv, h)),
        ("self_attn.v_proj.weight", (kv, h)),
        ("self_attn.o_proj.weight", (h, q)),
        *mlp,
        ("input_layernorm.weight", (h,)),
        ("post_attention_layernorm.weight", (h,)),
    ]
    if cfg.attention_bias:
        params += [("self_attn.q_proj.bias", (q,)), ("self_attn.k_proj.bias", (kv,)),
                   ("self_attn.v_proj.bias", (kv,))]
    if cfg.o_proj_bias:
        params.append(("self_attn.o_proj.bias", (h,)))
    if cfg.qk_norm:
        params += [("self_attn.q_norm.weight", (cfg.head_size,)), ("self_attn.k_norm.weight", (cfg.head_size,))]
    if cfg.attention_sinks:
        params.append(("self_attn.sinks", (cfg.num_attention_heads,)))
    return params


def hf_name(unit: str, name: str) -> str:
    """Full Hugging Face state-dict name of a unit's parameter."""
    if unit == "embed":
        return "model.embed_tokens.weight"
    if unit == "head":
        return "lm_head.weight" if name == "lm_head.weight" else "model.norm.weight"
    return f"model.{unit}.{name}"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D], weight: [D]. Normalises in fp32, returns x's dtype (as HF does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_cache(cfg: ModelConfig, seq_len: int, device: torch.device, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [seq_len, rotary_dim] for positions 0..seq_len-1, computed in fp32 then cast;
    rotary_dim is head_size but with ``partial_rotary_factor`` < 1 (GLM-4.5), whose frequencies are
    those of a head of rotary_dim dims (as transformers computes them) and which rotates only the
    first rotary_dim dims of q and k (:func:`_apply_rope`).

    With ``rope_scaling`` of type llama3 (Llama 3.1+), the frequencies are rescaled by wavelength as
    transformers' ``_compute_llama3_parameters`` does: wavelengths shorter than
    original_max_position_embeddings / high_freq_factor are kept, those longer than .../low_freq_factor
    are divided by factor, and those between are interpolated smoothly between the two. With type
    yarn (gpt-oss): :mod:`megatrain_ray.model.yarn`'s frequencies, cos and sin times its attention factor.
    """
    d = cfg.rotary_dim
    if cfg.rope_scaling is not None and cfg.rope_scaling.get("rope_type") == "yarn":
        inv_freq, scale = yarn_frequencies(cfg.rope_scaling, cfg.rope_theta, d, device)
        freqs = torch.arange(seq_len, device=device, dtype=torch.float)[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float, device=device) / d))
    if cfg.rope_scaling is not None:  # rope_type llama3, the other one ModelConfig.validate accepts
        rs = cfg.rope_scaling
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_len = rs["original_max_position_embeddings"]
        wavelen = 2 * torch.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    freqs = torch.arange(seq_len, device=device, dtype=torch.float)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_at(rope: tuple[torch.Tensor, torch.Tensor], position_ids: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [P, d] tables of :func:`rope_cache`; position_ids: [B, S] int64 (< P) -> cos, sin: [B, S, d]."""
    cos, sin = rope
    return cos[position_ids], sin[position_ids]


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """position_ids: [B, S], 0 where a document starts -> [B, S] int64, the document index of each token."""
    return (position_ids == 0).long().cumsum(-1)


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """position_ids: [B, S] -> [B, 1, S, S] bool: query i may attend key j iff j <= i in the same document."""
    doc = document_ids(position_ids)
    s = position_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=position_ids.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def layer_mask(cfg: ModelConfig, layer: int, mask, seq: int, device, position_ids: torch.Tensor | None = None):
    """The mask decoder layer ``layer`` attends with, given the sequence's full-attention ``mask``
    (None: causal, or :func:`document_mask`'s): that one, or for a sliding-window layer
    (``cfg.window(layer)``) the dense window mask of :func:`~megatrain_ray.model.sink_attention.window_mask`
    (position_ids [B, S]: packed documents, or None)."""
    window = cfg.window(layer)
    return mask if window is None else window_mask(seq, window, device, position_ids)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, S, d]; cos/sin: [S, r], or [B, S, r] (per-sequence positions), r <= d: the first
    r dims of each head are rotated (rotate-half within them), the other d - r pass through."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


PROJECTION_GROUPS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                     "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
"""Projections that read the same input, keyed by the name their concatenation may be passed under
(see the module docstring and :func:`project`)."""


def project(p: Params, x: torch.Tensor, group: str) -> tuple[torch.Tensor, ...]:
    """The outputs of a group of :data:`PROJECTION_GROUPS`, in member order. x: [..., H] -> each [..., out_i].

    ``p`` holds every member's ``weight`` [out_i, H] (and ``bias`` [out_i] if the member has one).
    If it also holds ``{group}.weight`` [sum out_i, H], the members' weights stacked along dim 0 (and
    ``{group}.bias`` when they have biases), that is used instead: one GEMM, split. Same values.
    Members with an adapter add its term (:func:`add_low_rank`) either way.
    """
    members = PROJECTION_GROUPS[group]
    if f"{group}.weight" not in p:
        return tuple(linear(p, m, x) for m in members)
    out = F.linear(x, p[f"{group}.weight"], p.get(f"{group}.bias"))
    outs = out.split([p[f"{m}.weight"].shape[0] for m in members], dim=-1)
    return tuple(add_low_rank(p, m, x, o) for m, o in zip(members, outs))


def attention(p: Params, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cfg: ModelConfig,
              mask=None) -> torch.Tensor:
    """Causal grouped-query self-attention. x: [B, S, H] -> [B, S, H].

    mask: None (causal over the whole sequence), a [B, 1, S, S] bool tensor (True = may attend) or
    a FlexAttention ``BlockMask`` (see the module docstring on packed documents and sliding windows).
    With ``self_attn.sinks`` in p, the attention with sinks of :mod:`~megatrain_ray.model.sink_attention`.
    """
    b, s, _ = x.shape
    d = cfg.head_size
    q, k, v = project(p, x, "self_attn.qkv_proj")
    q = q.reshape(b, s, -1, d)
    k = k.reshape(b, s, -1, d)
    if cfg.qk_norm:
        q = rms_norm(q, p["self_attn.q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, p["self_attn.k_norm.weight"], cfg.rms_norm_eps)
    else:  # v in storage of its own (a copy where it is a slice of the fused q/k/v output): the
        # attention's backward saves v, and a slice would hold q's and k's parts of that output too
        # (with qk_norm the norms' backward holds them anyway)
        v = v.contiguous()
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.reshape(b, s, -1, d).transpose(1, 2)
    cos, sin = rope
    q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
    gqa = cfg.num_key_value_heads != cfg.num_attention_heads
    if "self_attn.sinks" in p:
        sinks = p["self_attn.sinks"]
        if mask is None or isinstance(mask, torch.Tensor):
            out = sink_attention(q, k, v, sinks, mask)
        else:
            out = flex_sink_attention(q, k, v, sinks, mask)
    elif mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    elif isinstance(mask, torch.Tensor):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    else:
        out = flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
    out = out.transpose(1, 2).reshape(b, s, -1)
    return linear(p, "self_attn.o_proj", out)


def mlp_activation(p: Params, h: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The SwiGLU MLP's hidden activation, the input of its down projection: silu(gate) * up of the
    post-attention norm of h. h: [B, S', H] -> [B, S', intermediate], position-wise."""
    gate, up = project(p, rms_norm(h, p["post_attention_layernorm.weight"], cfg.rms_norm_eps), "mlp.gate_up_proj")
    return F.silu(gate) * up


def attention_block(p: Params, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cfg: ModelConfig,
                    mask=None) -> torch.Tensor:
    """The first half of a decoder layer: x + attention(norm(x)). x: [B, S, H] -> [B, S, H]."""
    return x + attention(p, rms_norm(x, p["input_layernorm.weight"], cfg.rms_norm_eps), rope, cfg, mask)


def mlp_block(p: Params, h: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The second half: h + down_proj(:func:`mlp_activation`), position-wise, or in a sparse layer h +
    the mixture of experts of the normed h. h: [B, S', H] -> [B, S', H] for any S'."""
    if is_sparse(p):
        return h + sparse_mlp(p, rms_norm(h, p["post_attention_layernorm.weight"], cfg.rms_norm_eps), cfg)[0]
    return h + linear(p, "mlp.down_proj", mlp_activation(p, h, cfg))


def routed_layer(p: Params, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cfg: ModelConfig,
                 mask=None, tokens: torch.Tensor | None = None, chosen: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, RouterStats]:
    """A sparse decoder layer, with its router's statistics (for the load-balancing loss, see
    :mod:`megatrain_ray.model.moe`). x: [B, S, H] -> ([B, S, H], RouterStats); rope, mask: see
    :func:`attention`; tokens: [B, S] bool, transformers' attention mask (False: padding, which the
    statistics leave out), or None; chosen: [B*S, k], the experts an earlier run of the layer on
    the same x chose (:func:`~megatrain_ray.model.moe.route`), or None."""
    h = attention_block(p, x, rope, cfg, mask)
    out, stats = sparse_mlp(p, rms_norm(h, p["post_attention_layernorm.weight"], cfg.rms_norm_eps), cfg, tokens,
                            chosen)
    return h + out, stats


def decoder_layer(p: Params, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cfg: ModelConfig,
                  mask=None) -> torch.Tensor:
    """One pre-norm decoder layer. x: [B, S, H] -> [B, S, H]; rope, mask: see :func:`attention`."""
    return mlp_block(p, attention_block(p, x, rope, cfg, mask), cfg)


def embed(p: Params, ids: torch.Tensor) -> torch.Tensor:
    """ids: [B, S] int64 -> [B, S, H]."""
    return F.embedding(ids, p["weight"])


def final_norm(p: Params, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """x: [B, S, H] -> [B, S, H]."""
    return rms_norm(x, p["norm.weight"], cfg.rms_norm_eps)


def lm_head_weight(head: Params, embed_params: Params | None) -> torch.Tensor:
    """The [V, H] output projection: the head's own, or the embedding matrix when tied."""
    return head["lm_head.weight"] if "lm_head.weight" in head else embed_params["weight"]


def token_loss_sum(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over non-ignored tokens. h: [N, H], w: [V, H], labels: [N] -> scalar fp32.

    Logits are upcast to fp32 before the softmax.
    """
    logits = F.linear(h, w).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def forward_hidden(cfg: ModelConfig, read: UnitReader, ids: torch.Tensor, layer: Callable = decoder_layer,
                   dtype: torch.dtype | None = None, position_ids: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole model up to the LM head, unit after unit: ids [B, S] int64 -> (final-normed hidden
    [B, S, H], the LM-head weight [V, H]).

    The one whole-model forward of the codebase (evaluation and the resident reference run it; the
    engine runs the same functions layer-major over micro-batches). ``read`` gives each unit's params;
    ``layer`` is :func:`decoder_layer` or a form of it that computes the same (compiled, recomputed in
    the backward); ``dtype``: the activations' dtype after the embedding and the rope tables' (None:
    the embedding's, and fp32 tables); ``position_ids`` [B, S]: packed documents (positions within
    each token's document), attended within their document only (see :func:`document_mask`).
    """
    embed_params = read("embed")
    x = embed(embed_params, ids)
    if dtype is not None:
        x = x.to(dtype)
    if position_ids is None:
        rope, mask = rope_cache(cfg, ids.shape[-1], ids.device, dtype or torch.float32), None
    else:
        table = rope_cache(cfg, int(position_ids.max()) + 1, ids.device, dtype or torch.float32)
        rope, mask = rope_at(table, position_ids), document_mask(position_ids)
    for i, unit in enumerate(unit_names(cfg)[1:-1]):
        m = layer_mask(cfg, i, mask, ids.shape[-1], ids.device, position_ids)
        x = layer(read(unit), x, rope, cfg) if m is None else layer(read(unit), x, rope, cfg, m)
    head = read("head")
    return final_norm(head, x, cfg), lm_head_weight(head, embed_params)
