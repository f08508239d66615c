"""The LM head (engine.compute.head): chunked loss and gradients, eager and through torch.compile (Inductor,
on the CPU here), tied and untied, with a shorter last chunk and ignored labels; a compiler that
fails makes the head warn once and run eagerly."""

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils

from megatrain_ray.config import ModelConfig
from megatrain_ray.engine.compute.head import chunk_loss_sum, head_forward_backward
from megatrain_ray.engine.compute.sequence import CompiledLayer
from megatrain_ray.model import transformer as M
from megatrain_ray.model.layout import LayerTemplate, StoreLayout

V, H, CHUNK = 96, 32, 8
U = 2.0 ** -24  # fp32 unit roundoff


def _head(tied: bool):
    """Config, templates, flat weights (head, embedding), hidden states 2 x [2, 10, H] and labels
    [2, 2, 10]: 20 tokens per micro-batch, so chunks of 8, 8 and a short 4; micro-batch 0 ignores its
    first 4 labels, micro-batch 1 its last chunk whole (a chunk that counts nothing)."""
    cfg = ModelConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V, tie_word_embeddings=tied)
    templates = [LayerTemplate.build(cfg, u) for u in M.unit_names(cfg)]
    g = torch.Generator().manual_seed(0)
    wh = torch.randn(templates[2].numel, generator=g) * 0.3
    templates[2].bind(wh)["norm.weight"].add_(1.0)
    we = torch.randn(templates[0].numel, generator=g) * 0.3
    hidden = [torch.randn(2, 10, H, generator=g) for _ in range(2)]
    labels = torch.randint(0, V, (2, 2, 10), generator=g)
    labels[0].view(-1)[:4] = M.IGNORE_INDEX
    labels[1].view(-1)[16:] = M.IGNORE_INDEX
    return cfg, templates, wh, we, hidden, labels


def _run(tied: bool, loss_fn=chunk_loss_sum):
    """(loss, input gradients [2, 2, 10, H], head gradient, embedding gradient) of head_forward_backward."""
    cfg, templates, wh, we, hidden, labels = _head(tied)
    embed_grad = torch.zeros(templates[0].numel)
    n = int((labels != M.IGNORE_INDEX).sum())
    loss, dxs, head_grad = head_forward_backward(cfg, StoreLayout.build(cfg), CHUNK, wh, we if tied else None, hidden, labels, n,
                                                 embed_grad, loss_fn)
    return loss, torch.stack(dxs), head_grad, embed_grad


def _close(got, want, n_sum: int):
    """fp32 results of the same math whose sums (n_sum terms at most) may run in another order:
    each differs by at most ~n_sum * u * (the sum of the terms' magnitudes), bounded here by 4 x that
    with the result's largest magnitude for the terms' (the terms are of the result's size or smaller
    and mostly of mixed sign: the log-sum-exp over V, the norm's mean over H, the weight gradients
    over the chunk's tokens and chunks; the GEMMs are the same aten calls in both)."""
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=4 * n_sum * U * float(w.abs().max()) + 1e-30)


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_head_is_the_mean_loss_over_counted_tokens(tied):
    """The chunked head (eager) gives the loss and gradients of one unchunked mean cross-entropy
    over the counted tokens, through the bound views of the flat weights."""
    cfg, templates, wh, we, hidden, labels = _head(tied)
    leaves = [wh.clone().requires_grad_(True), we.clone().requires_grad_(True)]
    xs = torch.stack(hidden).requires_grad_(True)
    head = templates[2].bind(leaves[0])
    w = M.lm_head_weight(head, templates[0].bind(leaves[1]) if tied else None)
    logits = M.final_norm(head, xs, cfg) @ w.T
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=M.IGNORE_INDEX)
    grads = torch.autograd.grad(want, [xs, *leaves], allow_unused=True)
    grads = [torch.zeros_like(we) if g is None else g for g in grads]
    loss, dx, head_grad, embed_grad = _run(tied)
    _close([loss, dx, head_grad, embed_grad], [want.detach(), *grads], V)
    if not tied:
        assert not embed_grad.any()


@pytest.mark.parametrize("tied", [False, True])
def test_compiled_head_matches_eager_with_two_static_graphs(tied):
    """The head's chunk loss through torch.compile gives the eager loss and gradients (input, norm,
    LM-head or tied embedding) within fp32 summation-order bounds; the full chunks and the short
    last one are two static graphs, compiled once each."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = CompiledLayer(fn=chunk_loss_sum, what="LM head", backward_at_forward=True, warn=pytest.fail)
    got = _run(tied, compiled)
    got_again = _run(tied, compiled)  # no recompile on the second step
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    eager = _run(tied)
    _close(got, eager, V)
    for a, b in zip(got_again, got):
        assert torch.equal(a, b)


def _broken(graph, inputs):
    raise RuntimeError("no compiler here")


def _broken_backward():
    """A backend whose forward compiles and whose backward compiler fails (lowered lazily, at the
    first backward, unless the forward call lowers it)."""
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(fw_compiler=lambda gm, example: gm, bw_compiler=_broken)


@pytest.mark.parametrize("backend", [_broken, _broken_backward()], ids=["forward", "backward"])
def test_head_compile_failure_falls_back_to_eager_with_one_warning(backend):
    """A compiler that fails, for the forward or only for the backward graph, makes the head warn once
    and run the eager chunk loss: the eager results exactly."""
    torch._dynamo.reset()
    warnings = []
    compiled = CompiledLayer(fn=chunk_loss_sum, what="LM head", backward_at_forward=True, warn=warnings.append,
                             backend=backend)
    eager = _run(True)
    for _ in range(2):
        for got, want in zip(_run(True, compiled), eager):
            assert torch.equal(got, want)
    assert len(warnings) == 1 and "LM head" in warnings[0] and "no compiler here" in warnings[0]
