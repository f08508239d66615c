"""Attention with learned sinks, and sliding-window masks (gpt-oss), architecture only.

**Sinks.** Each head h has a learned logit ``sinks[h]`` that joins every query's softmax as one
more column and is then dropped: p_j = exp(s_j) / (sum_k exp(s_k) + exp(sink_h)), so a query may
put weight "nowhere". With Z = exp(lse) the sum over the allowed keys, the output is the plain
attention's output times Z / (Z + exp(sink)) = sigmoid(lse - sink). Two ways to compute it:

- :func:`sink_attention` (the reference, any device, any mask): the scores [B, h, S, S] written
  out, the sink column appended, the softmax in fp32, the column dropped. Chosen for the CPU (and
  dense masks) because it is plainly what transformers' eager ``GptOssAttention`` computes, so the
  CPU parity holds to rounding, and autograd gives the sinks their gradient with no extra code;
  it costs O(S^2) memory per head, so it is the small-shape path.
- :func:`flex_sink_attention` (CUDA, a FlexAttention ``BlockMask``): FlexAttention's output and
  log-sum-exp, the output rescaled by sigmoid(lse - sink). FlexAttention differentiates through its
  log-sum-exp, so the sinks, queries and keys get the sink column's gradient too; no S x S tensor.
  SDPA / flash would do the same were their log-sum-exp differentiable through the public API; it
  is not, hence FlexAttention (which also takes the sliding window as a block-sparse mask).

**Sliding windows.** A layer that layer_types marks ``sliding_attention`` lets query i see key j
iff j <= i and i - j < window (transformers' sliding-window causal mask); with packed documents,
also only within i's document. :func:`window_mask` is that rule as a dense boolean mask; the
caller hands each layer its mask (:func:`megatrain_ray.model.transformer.layer_mask`).
"""

from __future__ import annotations

import torch


def window_mask(seq: int, window: int | None, device, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[B or 1, 1, S, S] bool, True where query i may attend key j: j <= i, i - j < window (None: no
    limit), and with position_ids [B, S] (packed documents, 0 where one starts) the same document."""
    i = torch.arange(seq, device=device)
    allowed = i[:, None] >= i[None, :]
    if window is not None:
        allowed = allowed & (i[:, None] - i[None, :] < window)
    if position_ids is None:
        return allowed[None, None]
    doc = (position_ids == 0).long().cumsum(-1)
    return ((doc[:, :, None] == doc[:, None, :]) & allowed)[:, None]


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:
    """q: [B, h, S, d], k, v: [B, kv, S, d] (kv dividing h), sinks: [h], mask: [B or 1, 1, S, S] bool
    (True: may attend) or None (causal) -> [B, h, S, d]: softmax(q k^T / sqrt(d) with the sink column)
    without that column, times v. The softmax runs in fp32, its weights cast to v's dtype."""
    b, h, s, d = q.shape
    rep = h // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1)) * d ** -0.5  # [B, h, S, S]
    allowed = window_mask(s, None, q.device) if mask is None else mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.to(scores.dtype)[None, :, None, None].expand(b, h, s, 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1).float(), dim=-1)[..., :-1]
    return torch.matmul(weights.to(v.dtype), v)


def flex_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, block_mask
                        ) -> torch.Tensor:
    """:func:`sink_attention` through FlexAttention with a ``BlockMask`` (see the module docstring):
    the attention's output times sigmoid(lse - sink), per head. Shapes as there."""
    from torch.nn.attention.flex_attention import flex_attention

    out, lse = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1], return_lse=True)
    scale = torch.sigmoid(lse.float() - sinks.float()[None, :, None])  # [B, h, S]
    return (out.float() * scale[..., None]).to(out.dtype)
