"""The step's last unit on the device: final norm, LM head and loss over token chunks, forward and
backward at once (the compute worker's head), and the same forward alone for validation data.

Each chunk's fp32 logits and the norm's fp32 temporaries exist for one chunk of ``chunk`` tokens at
a time, so what grows with the sequence is only the input gradient being filled ([S, H] in the
compute dtype); the [S, vocabulary] logits never exist whole.
"""

from __future__ import annotations

import torch

from ..model.transformer import IGNORE_INDEX, final_norm, lm_head_weight, token_loss_sum


def head_forward_backward(cfg, templates, chunk: int, wh: torch.Tensor, we: torch.Tensor | None,
                          hidden: list[torch.Tensor], labels: torch.Tensor, n_tokens: int, embed_grad: torch.Tensor
                          ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Loss and gradients of the head for the step's micro-batches.

    cfg: the model config; templates: the layout's unit templates; wh: the head unit's flat weights
    [numel], a leaf requiring grad; we: the embedding unit's [numel] when the embeddings are tied
    (a leaf too), else None; hidden: M x [B, S, H]; labels: [M, B, S]; n_tokens: the step's counted
    tokens (the loss is their mean). Returns (loss, M x [B, S, H] input gradients, the head's fp32
    gradient [numel]); with tied embeddings the LM-head part is added into ``embed_grad`` [V*H] fp32.
    """
    unit = cfg.num_hidden_layers + 1
    tied = we is not None
    head_grad = torch.zeros(templates[unit].numel, dtype=torch.float32, device=wh.device)
    loss = torch.zeros((), dtype=torch.float32, device=wh.device)
    dxs = []
    for m, x in enumerate(hidden):
        flat_x = x.detach().reshape(-1, x.shape[-1])
        flat_labels = labels[m].reshape(-1)
        dx = torch.empty_like(flat_x)
        for s in range(0, flat_x.shape[0], chunk):
            xc = flat_x[s:s + chunk].requires_grad_(True)
            with torch.enable_grad():
                head = templates[unit].bind(wh)
                w = lm_head_weight(head, templates[0].bind(we) if tied else None)
                part = token_loss_sum(final_norm(head, xc, cfg), w, flat_labels[s:s + chunk]) / n_tokens
            dx[s:s + chunk], gwh, *gwe = torch.autograd.grad(part, (xc, wh, *([we] if tied else [])))
            head_grad += gwh
            if tied:
                embed_grad += gwe[0]
            loss += part.detach()
        dxs.append(dx.view_as(x))
    return loss, dxs, head_grad


@torch.no_grad()
def head_loss(cfg, templates, chunk: int, wh: torch.Tensor, we: torch.Tensor | None, hidden: list[torch.Tensor],
              labels: torch.Tensor) -> torch.Tensor:
    """Mean loss over the counted tokens of hidden states E x [B, S, H] with labels [E, B, S] (forward only)."""
    unit = cfg.num_hidden_layers + 1
    head = templates[unit].bind(wh)
    w = lm_head_weight(head, templates[0].bind(we.detach()) if we is not None else None)
    total = torch.zeros((), dtype=torch.float32, device=wh.device)
    for e, lab in zip(hidden, labels):
        h = e.reshape(-1, e.shape[-1])
        lab = lab.reshape(-1)
        for s in range(0, h.shape[0], chunk):
            total += token_loss_sum(final_norm(head, h[s:s + chunk], cfg), w, lab[s:s + chunk])
    return total / (labels != IGNORE_INDEX).sum().clamp_min(1)
