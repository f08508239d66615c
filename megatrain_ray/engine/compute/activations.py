"""Where each decoder layer's activations wait for its backward, one of four placements per layer.

- :data:`KEEP`: the layer's whole autograd graph from the forward stays on the device (its forward
  runs with gradients on, against a device copy of its weights, since the weight slot is reused),
  and its backward differentiates that graph: no recompute, about a quarter of the layer's GEMM
  work saved, for :func:`kept_bytes_per_token` bytes per token instead of one hidden vector.
- :data:`GPU`: only the layer's input (the checkpoint) stays on the device and the backward
  recomputes the layer's forward from it (the default before placements existed).
- :data:`HOST`: the checkpoint is copied to a pinned host buffer (on the copy-out stream,
  overlapping the next layer's forward) as soon as the forward has used it, and copied back (on
  the copy-in stream) one layer ahead of the backward that recomputes from it.
- :data:`SPAN`: no checkpoint of its own. The layer belongs to a *recompute span*: the checkpointed
  layer before it and the span layers that follow (:func:`recompute_spans`). When the backward
  reaches a span's last layer, the forward of the span's layers before it is run again from the
  span's checkpoint (their weights streamed once more, in forward order), their inputs held on the
  device until each one's backward has used them. Same function on the same values as the first
  forward, so the same inputs bit for bit and the same gradients; what it costs is one more
  forward of every span layer but the last, and the weights fetched again for it.

Per layer, :func:`layer_modes` lays a placement out as the first ``host`` checkpoints offloaded
(their backwards come last, so their copies back have the most time), the last ``keep`` layers
kept whole, the rest checkpointed on the device, ``span`` layers spread over the non-kept ones as
evenly as possible; the planner (:mod:`megatrain_ray.orchestration.device_memory`) picks the
counts from free device memory (and, for spans, host memory). The placements give the same values:
the kept graph is the one the recompute would rebuild, from the same input with the same weights,
run by the same function, and a span's inputs are those its forward computed.

With offloading, the compute thread enqueues work far ahead of the device; memory that waits for a
copy is only reused once the copy has run, so the thread is held to at most :data:`LEAD` layers
ahead of the device, or device memory would fill with activations whose copies have not run yet.
The host buffers are allocated once, at the first step, and reused (torch's pinned allocator
rounds each up to a power of two bytes, so they may take up to twice the checkpoints' size).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .grad_sum import accumulate

LEAD = 2
"""Layers the compute thread may run ahead of the device while activations are offloaded."""
KEEP, GPU, HOST, SPAN = "keep", "gpu", "host", "span"
"""A layer's placement: whole graph kept on the device, input checkpoint on the device, input
checkpoint in pinned host memory, no checkpoint (recomputed within its span)."""


def layer_modes(n_layers: int, keep: int, host: int, span: int = 0) -> tuple[str, ...]:
    """The placement of layers 0..n_layers-1: the last ``keep`` kept whole; the others in
    ``n_layers - keep - span`` groups of sizes as even as possible (the longer first), each a
    checkpointed layer followed by its span layers; the first ``host`` groups' checkpoints offloaded."""
    rest = n_layers - keep
    groups = rest - span
    if min(keep, host, span) < 0 or keep + span > n_layers or host > groups or (span and groups < 1):
        raise ValueError(f"cannot keep {keep}, offload {host} and span {span} of {n_layers} layers")
    modes: list[str] = []
    for g in range(groups):
        size = rest // groups + (g < rest % groups)
        modes += [HOST if g < host else GPU] + [SPAN] * (size - 1)
    return (*modes, *(KEEP,) * keep)


def recompute_spans(modes: Sequence[str]) -> tuple[tuple[int, int], ...]:
    """(first, last) decoder layer of every recompute span in ``modes``: a checkpointed layer and the
    :data:`SPAN` layers after it (two layers or more)."""
    spans, first = [], None
    for layer, mode in enumerate((*modes, None)):
        if mode == SPAN:
            continue
        if first is not None and layer - 1 > first:
            spans.append((first, layer - 1))
        first = layer if mode in (GPU, HOST) else None
    return tuple(spans)


def recomputed_layers(modes: Sequence[str]) -> tuple[int, int]:
    """(decoder-layer forwards the backward recomputes from a checkpoint, up to the down projection:
    one per layer without a kept graph; whole forwards run again within recompute spans: every
    span layer but the last) under placement ``modes``."""
    return sum(mode != KEEP for mode in modes), sum(last - first for first, last in recompute_spans(modes))


LEAN_PARTITIONER = {"ban_recompute_used_far_apart": False, "ban_recompute_long_fusible_chains": False,
                    "ban_recompute_materialized_backward": False}
"""torch._functorch.config settings under which :class:`~megatrain_ray.engine.compute.sequence.CompiledLayer`
compiles the layer's training graph: the min-cut partitioner with three of its bans on recomputation
lifted, so it recomputes the norms' outputs and silu(gate) * up in the backward (elementwise work
fused into the backward's kernels) instead of saving them: -33% kept bytes at the 7B shape. The
allowlist of recomputable ops stays, so no GEMM and no attention is ever recomputed. This is the
first step of ``activation_memory_budget`` < 1 (its "more aggressive" min cut, taken when it meets
the budget: it keeps about two thirds of the default's activations at the Qwen2.5-7B, Llama-3-8B
and Qwen3-8B shapes, 0.77 for a small qk_norm layer), without the budget's later steps, which recompute
attention (0.6 on the CPU) or GEMMs where that first cut does not meet it."""


def lean_partitioner() -> dict | None:
    """:data:`LEAN_PARTITIONER`, or None where this torch lacks one of its settings (its default
    partitioner then, which saves what :func:`kept_bytes_per_token` counts with ``lean=False``)."""
    import torch._functorch.config as functorch_config

    if all(hasattr(functorch_config, key) for key in LEAN_PARTITIONER):
        return LEAN_PARTITIONER
    return None


def kept_bytes_per_token(cfg, itemsize: int, compiled: bool = False, lean: bool | None = None) -> int:
    """Device bytes one token's kept graph of one decoder layer holds (weights and the step's RoPE
    cache not counted, the layer's input counted), for a compute dtype of ``itemsize`` bytes, run
    eagerly or (``compiled``) through torch.compile, whose partitioner recomputes cheap elementwise
    work in the backward instead of saving it; ``lean``: compiled under :data:`LEAN_PARTITIONER`
    (None: as :class:`~megatrain_ray.engine.compute.sequence.CompiledLayer` does with this torch).

    What :func:`~megatrain_ray.model.transformer.decoder_layer`'s autograd saves (tests/test_actplace.py
    checks it against saved-tensor hooks on Llama-shaped layers, with qk_norm too, eager and compiled,
    and compiled with q/k/v biases):

    - the norms, eager: each its fp32 upcast (4H; for fp32 inputs the input itself), the normalised
      value in the compute dtype and its product with the weight (2cH), the fp32 reciprocal RMS (4);
      plus the layer's input (cH), which a 16-bit run does not save (it saves its upcast) but the
      backward needs as the leaf it differentiates to. Compiled: the input, the attention's output
      projection (2cH: the residual between the norms is their sum) and the two reciprocal RMS (8),
      and, not lean, both norms' outputs (2cH more);
    - attention, both: v (ckv, a copy of its own where it is a slice of the fused q/k/v output;
      with qk_norm the whole fused output, c(q + 2kv), v a view of it), the rotated q and k
      (c(q + kv)), the attention output (cq, the o_proj input is a view of it) and the fp32
      log-sum-exp per head (4 heads); with qk_norm, the norms over q and k: eager, each its fp32
      upcast (for fp32, a view of the fused output), its normalised value and the reciprocal RMS
      per head; compiled, the reciprocal RMS per head only (the rest recomputed from the fused output);
    - the MLP, eager: the fused gate/up output (2cI), silu(gate) and silu(gate) * up (2cI);
      compiled: the fused gate/up output (2cI) and, not lean, silu(gate) * up (cI more).
    """
    c, h, i = itemsize, cfg.hidden_size, cfg.intermediate_size
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_size
    q, kv = heads * d, kv_heads * d
    attn = c * (q + 2 * kv if cfg.qk_norm else kv) + c * (q + kv) + c * q + 4 * heads
    if cfg.qk_norm:
        attn += (0 if compiled else (4 * (c < 4) + c) * (q + kv)) + 4 * (heads + kv_heads)
    if compiled:
        if lean is None:
            lean = lean_partitioner() is not None
        return 2 * c * h + 8 + attn + 2 * c * i + (0 if lean else 2 * c * h + c * i)
    return 2 * (4 * h + 2 * c * h + 4) + (c * h if c < 4 else 0) + attn + 4 * c * i


def sparse_kept_bytes_per_token(cfg, itemsize: int) -> int:
    """:func:`kept_bytes_per_token` (eager) for a sparse layer of a mixture of experts: the attention
    half and the norms as a dense layer's, and instead of the dense MLP's 4cI what
    :func:`~megatrain_ray.model.moe.sparse_mlp`'s autograd saves per token: the router's fp32
    probabilities (4E), the top-k's indices, the dispatch order and its inverse (3 x 8 per pair),
    the renormalised fp32 weights (4 per pair, their sum 4) and their compute-dtype copy (c per pair);
    per (token, expert) pair the gathered row and the weighted output's input (2cH) and the
    gate/up output, silu(gate) and its product with up (4cI, I the expert width); the shared
    expert's 4cS with its gate's sigmoid (c) and output (cH); and one more cH for the normed input
    the router and the gather read beside the norm's own output. Checked in tests/test_moe_streaming.py
    against saved-tensor hooks on the CPU (eager, fp32 and bf16): at most 8% above what is saved.
    The compiled layer saves no more."""
    c, h, k = itemsize, cfg.hidden_size, cfg.num_experts_per_tok
    s = cfg.shared_expert_size
    dense_mlp = 4 * c * cfg.intermediate_size
    routed = 4 * cfg.num_experts + 4 + k * (3 * 8 + 4 + c + 2 * c * h + 4 * c * cfg.expert_size)
    return kept_bytes_per_token(cfg, c) - dense_mlp + routed + (4 * c * s + c + c * h if s else 0) + c * h


@dataclass
class KeptGraph:
    """A layer's forward for every micro-batch with its autograd graph, waiting for the backward.

    weights: the layer's flat weights, copied out of their slot (the graph saves views of them);
    leaves: the per-parameter leaves the forward used (views of ``weights``); inputs, outputs:
    M x [B, S, H], the leaves the graph starts from and the tensors it ends in.
    """

    weights: torch.Tensor
    leaves: dict[str, torch.Tensor]
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]


def graph_backward(leaves: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, dy: torch.Tensor,
                   grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """Backpropagate dy through one micro-batch's layer graph (leaves, x -> y; x, y, dy: [B, S, H]; or
    y, dy lists of outputs and their gradients, e.g. a sparse layer's with its router's probabilities).

    Adds each weight's gradient into ``grads`` (views into the layer's fp32 gradient buffer) and
    returns the input gradient. Each parameter is its own autograd leaf (a view, no copy), so its
    gradient lands straight in its place in the flat buffer rather than being assembled into a
    whole-layer gradient first.
    """
    names = [name for name, w in leaves.items() if w.requires_grad]  # a LoRA run's base: frozen, no gradient
    *gws, dx = torch.autograd.grad(y, [*(leaves[n] for n in names), x], dy, allow_unused=True)
    accumulate(grads, names, gws)  # the parts of a fused projection get none: theirs comes through the fused view
    return dx


def layer_forward_kept(layer_fn, template, flat: torch.Tensor, xs: list[torch.Tensor], contexts: list[tuple],
                       cfg, adapters: dict[str, torch.Tensor] | None = None, frozen: bool = False,
                       dropout=None) -> KeptGraph:
    """One layer's forward for every micro-batch (xs: M x [B, S, H]) with its graph kept for the backward.

    flat: the layer's weights in their slot, copied first, since the slot is reused before the
    backward and the graph saves the weights it multiplied by. The same function on the same values
    as the recompute of :func:`~megatrain_ray.engine.compute.sequence.layer_backward`, so the backward of the kept graph is that of the
    recompute, without running it (the untiled layer: a kept graph holds every MLP chunk anyway).
    contexts: M x (rope, mask), see :func:`~megatrain_ray.engine.compute.sequence.step_contexts`, or (rope,
    mask, tokens) for a sparse layer's ``layer_fn``, which takes tokens after mask. adapters: a
    LoRA run's adapters of the layer (resident, not copied), leaves that train; frozen: the layer's
    own weights do not (its policy), so the graph's backward computes no gradient for them; dropout:
    micro-batch m's adapter dropout masks, or None.
    """
    weights = flat.clone()
    leaves = {name: w.detach().requires_grad_(not frozen) for name, w in template.bind(weights, fused=True).items()}
    leaves.update({name: w.detach().requires_grad_(name.endswith(".weight"))  # not a scaling, not a dropout mask
                   for name, w in (adapters or {}).items()})
    inputs = [x.detach().requires_grad_(True) for x in xs]
    with torch.enable_grad():
        outputs = [layer_fn(leaves if dropout is None else {**leaves, **dropout(m)}, x, rope, cfg, *rest)
                   for m, (x, (rope, *rest)) in enumerate(zip(inputs, contexts))]
    return KeptGraph(weights, leaves, inputs, outputs)


def kept_backward(graph: KeptGraph, grads: dict[str, torch.Tensor], dx: list[torch.Tensor]) -> None:
    """:func:`~megatrain_ray.engine.compute.sequence.layer_backward` for a layer whose forward graph was kept: dx (M x [B, S, H]) replaced
    by the input gradients, the graph freed micro-batch by micro-batch."""
    for m in range(len(dx)):
        dx[m] = graph_backward(graph.leaves, graph.inputs[m], graph.outputs[m], dx[m], grads)
        graph.inputs[m] = graph.outputs[m] = None


class ActivationStore:
    """Each decoder layer's activations by its layer index (0-based), placed per :func:`layer_modes`."""

    def __init__(self, backend, modes: Sequence[str]):
        self.backend = backend
        self.modes = tuple(modes)
        self.spans = recompute_spans(self.modes)
        self._kept: dict[int, list[torch.Tensor] | KeptGraph] = {}
        self._stashed: dict[int, list[tuple[torch.Tensor, object]]] = {}
        self._fetched: dict[int, list[tuple[torch.Tensor, object]]] = {}
        self._host: dict[tuple[int, int], torch.Tensor] = {}
        self._marks: collections.deque = collections.deque()

    def mode(self, layer: int) -> str:
        """The placement of decoder layer ``layer``."""
        return self.modes[layer]

    def clear(self) -> None:
        """Forget every layer's activations (the host buffers stay for the next step)."""
        self._marks.clear()
        self._kept.clear()
        self._stashed.clear()
        self._fetched.clear()

    def keep(self, layer: int, graph: KeptGraph) -> None:
        """Hold ``layer``'s forward graph (a :data:`KEEP` layer) for its backward."""
        self._kept[layer] = graph

    def put(self, layer: int, xs: list[torch.Tensor]) -> None:
        """xs: M x [B, S, H], the input of ``layer`` for every micro-batch, no longer needed by the
        forward (a :data:`SPAN` layer's is dropped: its span's forward brings it back)."""
        if self.mode(layer) == SPAN:
            return
        if self.mode(layer) != HOST:
            self._kept[layer] = xs
            return
        self._wait_for_device()
        entries = []
        for m, x in enumerate(xs):
            host = self._host.get((layer, m))
            if host is None or host.shape != x.shape or host.dtype != x.dtype:
                host = self._host[(layer, m)] = self.backend.host_buffer(x.shape, x.dtype)
            entries.append((host, self.backend.stash(x, host, f"inputs of layers.{layer}")))
        self._stashed[layer] = entries

    def prefetch(self, layer: int) -> None:
        """Start bringing ``layer``'s inputs back to the device (no-op when kept there or absent)."""
        if layer in self._stashed and layer not in self._fetched:
            self._fetched[layer] = [self.backend.unstash(host, done, f"inputs of layers.{layer}")
                                    for host, done in self._stashed.pop(layer)]

    def set_inputs(self, layer: int, xs: list[torch.Tensor]) -> None:
        """Keep ``layer``'s inputs (M x [B, S, H]) on the device for its backward, whatever its
        placement: the inputs of a recompute span, brought back for the span's backward."""
        self._kept[layer] = xs

    def span_of(self, layer: int) -> tuple[int, int] | None:
        """(first, last) layer of the recompute span that ends at ``layer``, or None."""
        return next(((a, b) for a, b in self.spans if b == layer), None)

    def source(self, layer: int) -> int:
        """The layer whose stored checkpoint ``layer``'s backward starts from: its own, or its span's first."""
        return next((a for a, b in self.spans if a <= layer <= b), layer)

    def take(self, layer: int) -> list[torch.Tensor] | KeptGraph:
        """``layer``'s kept graph, or its inputs on the device ready for the compute stream; forgets them here."""
        if layer in self._kept:
            return self._kept.pop(layer)
        self._wait_for_device()
        self.prefetch(layer)
        out = []
        for x, ready in self._fetched.pop(layer):
            self.backend.wait(ready)
            out.append(x)
        return out

    def _wait_for_device(self) -> None:
        """Wait until the device has caught up to within LEAD layers of the compute thread."""
        self._marks.append(self.backend.mark())
        while len(self._marks) > LEAD:
            self.backend.host_wait(self._marks.popleft())
