"""The step's last unit on the device: final norm, LM head and loss over token chunks, forward and
backward at once (the compute worker's head), and the same forward alone for validation data.

Each chunk's fp32 logits and the norm's fp32 temporaries exist for one chunk of ``chunk`` tokens at
a time, so what grows with the sequence is only the input gradient being filled ([S, H] in the
compute dtype); the [S, vocabulary] logits never exist whole.

With ``compute.compile`` on, a chunk's loss (:func:`chunk_loss_sum`) runs through ``torch.compile``
(:class:`~megatrain_ray.engine.compute.sequence.CompiledLayer`, with its eager fallback): Inductor fuses the
fp32 upcast, log-softmax and NLL, and in the backward the softmax minus the one-hot and its cast
back, around the two GEMMs, so that a chunk keeps its bf16 logits for the backward rather than
writing and reading several [chunk, V] fp32 tensors. Same math as the eager chunk: the softmax in
fp32, ignored labels excluded from the sum, the sum divided by the step's counted tokens outside
the compiled function (so that count is not compiled in). Shapes are static (``dynamic=False``): a
micro-batch's B x S tokens are the same every step (train.seq_len, micro_batch_size), so at most two
graphs are compiled, once: the full chunk and, where B x S is no multiple of the chunk, the last
shorter one. (Padding that chunk to full size with IGNORE_INDEX labels would give the same loss and
gradients, as ignored rows contribute exact zeros, but would run a whole chunk's GEMMs every step
to save one compile at step 1.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...model.transformer import IGNORE_INDEX, final_norm, lm_head_weight, token_loss_sum


def chunk_loss_sum(norm_weight: torch.Tensor, w: torch.Tensor, x: torch.Tensor, labels: torch.Tensor, cfg
                   ) -> torch.Tensor:
    """Summed loss of one chunk: x [N, H] -> final norm (weight [H]) -> logits x @ w.T ([V, H]) -> fp32
    cross-entropy over the labels [N] that are not IGNORE_INDEX -> scalar fp32. What the compiled head runs."""
    return token_loss_sum(final_norm({"norm.weight": norm_weight}, x, cfg), w, labels)


def head_forward_backward(cfg, layout, chunk: int, wh: torch.Tensor, we: torch.Tensor | None,
                          hidden: list[torch.Tensor], labels: torch.Tensor, n_tokens: int, embed_grad: torch.Tensor,
                          loss_fn: Callable = chunk_loss_sum, train_norm: bool = True, train_w: bool = True
                          ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
    """Loss and gradients of the head for the step's micro-batches.

    cfg: the model config; layout: its :class:`~megatrain_ray.model.layout.StoreLayout`; wh: the head unit's flat weights
    [numel]; we: the embedding unit's [numel] when the embeddings are tied, else None; hidden:
    M x [B, S, H]; labels: [M, B, S]; n_tokens: the step's counted tokens (the loss is their mean);
    loss_fn: :func:`chunk_loss_sum` or its compiled form. Returns (loss, M x [B, S, H] input
    gradients, the head's fp32 gradient [numel]); with tied embeddings the LM-head part is added
    into ``embed_grad`` [V*H] fp32. ``train_norm``, ``train_w``: whether the final norm's weight and
    the LM-head matrix train (a LoRA run's: neither, or the matrix alone); one that does not gets no
    gradient computed (the [V, H] GEMM of each chunk skipped for the matrix), and the head's gradient
    is None where none of its own tensors trains.

    The autograd leaves are the parameters' views (the norm weight, the [V, H] matrix), not the flat
    buffers: the gradient of a view of a flat leaf is a zero-filled [numel] tensor per view and chunk
    (slice_backward), ~1 GB each for a 7B head, summed before being added to the fp32 gradient.
    """
    head_t, embed_t = layout.templates[layout.head.index], layout.templates[layout.embed.index]
    tied = we is not None
    embed = embed_t.bind(we.detach()) if tied else None
    head = head_t.bind(wh.detach())
    norm_w = head["norm.weight"].requires_grad_(train_norm)
    w = lm_head_weight(head, embed).requires_grad_(train_w)
    own = train_norm or (train_w and not tied)
    head_grad = torch.zeros(head_t.numel, dtype=torch.float32, device=wh.device) if own else None
    grads = {} if head_grad is None else head_t.bind(head_grad)
    norm_grad = grads["norm.weight"] if train_norm else None
    w_grad = lm_head_weight(grads, embed_t.bind(embed_grad) if tied else None) if train_w else None
    trained = [(t, g) for t, g in ((norm_w, norm_grad), (w, w_grad)) if g is not None]  # leaf, its fp32 sum
    loss = torch.zeros((), dtype=torch.float32, device=wh.device)
    dxs = []
    for m, x in enumerate(hidden):
        flat_x = x.detach().reshape(-1, x.shape[-1])
        flat_labels = labels[m].reshape(-1)
        dx = torch.empty_like(flat_x)
        for s in range(0, flat_x.shape[0], chunk):
            xc = flat_x[s:s + chunk].requires_grad_(True)
            with torch.enable_grad():
                part = loss_fn(norm_w, w, xc, flat_labels[s:s + chunk], cfg) / n_tokens
            dx[s:s + chunk], *gs = torch.autograd.grad(part, (xc, *(t for t, _ in trained)))
            for (_, total), g in zip(trained, gs):
                total += g
            loss += part.detach()
        dxs.append(dx.view_as(x))
    return loss, dxs, head_grad


@torch.no_grad()
def head_loss(cfg, layout, chunk: int, wh: torch.Tensor, we: torch.Tensor | None, hidden: list[torch.Tensor],
              labels: torch.Tensor) -> torch.Tensor:
    """Mean loss over the counted tokens of hidden states E x [B, S, H] with labels [E, B, S] (forward
    only; eager: evaluation steps are rare, and a compiled forward-only graph would be one more compile)."""
    head = layout.templates[layout.head.index].bind(wh)
    embed_t = layout.templates[layout.embed.index]
    w = lm_head_weight(head, embed_t.bind(we.detach()) if we is not None else None)
    total = torch.zeros((), dtype=torch.float32, device=wh.device)
    for e, lab in zip(hidden, labels):
        h = e.reshape(-1, e.shape[-1])
        lab = lab.reshape(-1)
        for s in range(0, h.shape[0], chunk):
            total += token_loss_sum(final_norm(head, h[s:s + chunk], cfg), w, lab[s:s + chunk])
    return total / (labels != IGNORE_INDEX).sum().clamp_min(1)
