"""How the compute worker runs one decoder layer: forward, and recompute-backward from its checkpoint
(:func:`layer_backward`), eager or compiled (:class:`CompiledLayer`), over long sequences too.

Three things are applied here, around the model's pure functions, never inside them:

- **The recompute stops before the layer's last GEMM**: the backward of a checkpointed layer needs
  the down projection's input (the MLP activation) and the output gradient, never the layer's
  output, so the recompute runs the layer up to that activation (:func:`layer_to_down`) and the
  down projection's backward is two GEMMs by hand (:func:`down_backward`), the rest through
  autograd. Same math, same ops as differentiating the whole layer; the down projection's forward
  GEMM (~29% of a Qwen2.5-7B layer's forward FLOPs) is not run a second time.

- **Sequence tiling** (``memory.mlp_chunk_size`` > 0): the MLP half of the layer
  (:func:`~megatrain_ray.model.transformer.mlp_block`: post-attention norm, SwiGLU, down
  projection, residual) is position-wise, so it runs over chunks of the sequence one at a time and
  its [S, intermediate] tensors (gate, up, their product, and in the backward their gradients)
  exist for one chunk at a time: [chunk, intermediate] instead of [S, intermediate], the largest
  buffers of a layer at long context (intermediate ~ 5 x hidden). The backward recomputes the
  attention half with its graph, then each MLP chunk up to its activation, backpropagates the chunk at once
  (weight gradients added into the fp32 accumulators, the input gradient into its rows), and last
  backpropagates the attention half. Same math, same FLOPs as the untiled layer: the MLP forward
  is recomputed once per chunk (without its down projection), as the untiled backward recomputes it
  once; only the summation order of the weight gradients over tokens changes (per chunk into fp32).
- **Sparse layers** (a mixture of experts): run whole, untiled, and recomputed whole in the backward
  (:meth:`LayerRunner.forward_routed`, :meth:`LayerRunner.backward_routed`): the layer's router
  statistics come out of the forward (the step's expert counts, the load-balancing loss), and the
  backward takes the loss's gradient with respect to the router probabilities beside dy.
- **Packed documents**: the RoPE tables at each token's position in its document and the
  attention mask that keeps tokens within their document (:func:`step_contexts`): a dense
  [B, 1, S, S] boolean mask on the CPU (SDPA), a FlexAttention ``BlockMask`` on CUDA (O(S^2 / 128^2)
  memory; FlexAttention runs fast only compiled, i.e. with compute.compile on, the default there).
  Sliding-window layers (``cfg.window(i)``, gpt-oss) take contexts of their own, their masks limited
  to the window (:attr:`MicroBatches.windowed`); a model with attention sinks gets ``BlockMask`` s on
  CUDA even without packing (its FlexAttention path, :mod:`megatrain_ray.model.sink_attention`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...errors import PipelineError
from ...model.sink_attention import window_mask
from ...model.transformer import (IGNORE_INDEX, attention_block, decoder_layer, document_ids, document_mask,
                                 low_rank, mlp_activation, mlp_block, rope_at, rope_cache, routed_layer)
from .activations import lean_partitioner
from .grad_sum import accumulate, add_into

DOWN_PROJ = "mlp.down_proj"
DOWN = f"{DOWN_PROJ}.weight"
"""The layer's last GEMM, whose backward :func:`down_backward` runs by hand."""


def layer_to_down(p, x: torch.Tensor, rope, cfg, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~megatrain_ray.model.transformer.decoder_layer` without its down projection: x: [B, S, H]
    -> (h: [B, S, H], a: [B, S, intermediate]), the layer's output being h + a @ down_proj^T."""
    h = attention_block(p, x, rope, cfg, mask)
    return h, mlp_activation(p, h, cfg)


def down_backward(leaves: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], a: torch.Tensor,
                  dy: torch.Tensor) -> torch.Tensor:
    """The backward of y = h + a @ W^T through W (the down projection) alone, as autograd computes it:
    W's gradient dy^T a added into ``grads`` (fp32; not computed for a frozen W, absent from
    ``grads``), and returns a's gradient dy W. a: [B, S, I] (no graph needed), dy: [B, S, H] -> [B, S, I].
    An adapter of the down projection is differentiated with the rest (:func:`down_adapter`)."""
    if DOWN in grads:
        add_into(grads[DOWN], dy.reshape(-1, dy.shape[-1]).t().mm(a.reshape(-1, a.shape[-1])))
    return dy.matmul(leaves[DOWN])


def down_adapter(leaves: dict[str, torch.Tensor], act: torch.Tensor, dy: torch.Tensor
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The down projection's adapter term of a recompute, with its graph from ``act`` [B, S, I] (the
    activation as recomputed, with its graph), as (outputs, their gradients) to add to the
    backward's: ([scaling * B (A act)], [dy]); ([], []) when the down projection has no adapter."""
    with torch.enable_grad():
        extra = low_rank(leaves, DOWN_PROJ, act)
    return ([], []) if extra is None else ([extra], [dy])


def trainable_leaves(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each parameter as its own autograd leaf, requiring a gradient only where ``grads`` has a
    buffer for it: the frozen base of a LoRA run gets none, so its weight-gradient GEMMs never run."""
    return {name: w.detach().requires_grad_(name in grads) for name, w in params.items()}


def with_dropout(params: dict[str, torch.Tensor], dropout: Callable[[int], dict[str, torch.Tensor]] | None,
                 m: int) -> dict[str, torch.Tensor]:
    """``params`` with micro-batch ``m``'s adapter dropout masks beside them (as they are without dropout)."""
    return params if dropout is None else {**params, **dropout(m)}


def rows(params: dict[str, torch.Tensor], a: int, b: int) -> dict[str, torch.Tensor]:
    """``params`` for positions a..b of the sequence (an MLP chunk): the adapters' dropout masks
    ([B, S, in], position-wise like the input they mask) cut to them; the weights as they are."""
    masks = {n: t[:, a:b] for n, t in params.items() if n.endswith(".lora_dropout")}
    return {**params, **masks} if masks else params


class LayerRunner:
    """Forward (no gradients) and recompute-backward of one decoder layer, tiled or not.

    chunk: tokens per MLP chunk, 0 = untiled; wrap: turns a model function into the callable to run
    (``torch.compile`` through :class:`CompiledLayer`), or None = eager.
    """

    def __init__(self, chunk: int = 0, wrap: Callable | None = None):
        wrap = wrap or (lambda fn: fn)
        self.chunk = chunk
        self.layer = wrap(decoder_layer)
        """The forward, and a kept layer's forward with its graph."""
        self.to_down = wrap(layer_to_down)
        """The recompute of an untiled layer."""
        self.attn, self.mlp, self.mlp_act = ((wrap(attention_block), wrap(mlp_block), wrap(mlp_activation))
                                             if chunk else (None, None, None))
        self.routed = wrap(routed_layer)
        """A sparse layer, forward and recompute, with its router statistics."""

    def compiled(self) -> list:
        """The wrapped callables (for releasing the compiler's worker pool)."""
        return [f for f in (self.layer, self.to_down, self.attn, self.mlp, self.mlp_act, self.routed) if f is not None]

    def forward_routed(self, p, x: torch.Tensor, context: tuple, cfg, chosen: torch.Tensor | None = None):
        """A sparse layer's forward: x: [B, S, H] -> (its output [B, S, H], its RouterStats); context:
        (rope, mask, tokens) (:attr:`MicroBatches.routed_ctx`); chosen: [B*S, k], the experts its
        first forward sent the tokens to (a recompute span's forward again), or None."""
        rope, mask, tokens = context
        return self.routed(p, x, rope, cfg, mask, tokens, chosen)

    def backward_routed(self, leaves: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], x: torch.Tensor,
                        dy: torch.Tensor, context: tuple, cfg, dprobs: torch.Tensor | None, chosen: torch.Tensor
                        ) -> torch.Tensor:
        """Recompute a sparse layer from x: [B, S, H] with the experts its forward chose (chosen:
        [B*S, k]) and backpropagate dy: [B, S, H] and, unless None, dprobs [E], the loss's gradient
        with respect to its router's probability sums. Same conventions as :meth:`backward` but
        context (rope, mask, tokens); returns dx: [B, S, H]."""
        rope, mask, tokens = context
        x = x.detach().requires_grad_(True)
        names = [name for name, w in leaves.items() if w.requires_grad]
        weights = [leaves[name] for name in names]
        with torch.enable_grad():
            y, stats = self.routed(leaves, x, rope, cfg, mask, tokens, chosen)
        outputs, grads_out = ([y], [dy]) if dprobs is None else ([y, stats.prob_sum], [dy, dprobs])
        *gws, dx = torch.autograd.grad(outputs, [*weights, x], grads_out, allow_unused=True)
        accumulate(grads, names, gws)
        return dx

    def tiles(self, x: torch.Tensor) -> bool:
        """Whether a [B, S, H] input runs tiled (chunking on and S longer than one chunk)."""
        return 0 < self.chunk < x.shape[1]

    def _chunks(self, s: int):
        return ((a, min(a + self.chunk, s)) for a in range(0, s, self.chunk))

    def forward(self, p, x: torch.Tensor, context: tuple, cfg) -> torch.Tensor:
        """x: [B, S, H] -> the layer's output [B, S, H]; context: (rope, mask) from :func:`step_contexts`. Under no_grad (the compute worker's forward)
        the MLP chunks overwrite the attention half's output in place: no second [B, S, H] buffer."""
        rope, mask = context
        if not self.tiles(x):
            return self.layer(p, x, rope, cfg, mask)
        h = self.attn(p, x, rope, cfg, mask)
        out = torch.empty_like(h) if torch.is_grad_enabled() else h
        for a, b in self._chunks(x.shape[1]):
            out[:, a:b] = self.mlp(rows(p, a, b), h[:, a:b], cfg)
        return out

    def backward(self, leaves: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], x: torch.Tensor,
                 dy: torch.Tensor, context: tuple, cfg) -> torch.Tensor:
        """Recompute the layer from its input x: [B, S, H] and backpropagate dy: [B, S, H].

        leaves: the layer's parameters, each an autograd leaf; grads: fp32 buffers of the same names,
        accumulated into (a fused projection's members get theirs through the fused view, so they
        get None here and are skipped); context: (rope, mask). Returns dx: [B, S, H].
        """
        rope, mask = context
        x = x.detach().requires_grad_(True)
        names = [name for name, w in leaves.items() if w.requires_grad]
        weights = [leaves[name] for name in names]
        if not self.tiles(x):
            with torch.enable_grad():
                h, act = self.to_down(leaves, x, rope, cfg, mask)
            da = down_backward(leaves, grads, act.detach(), dy)
            extra, d_extra = down_adapter(leaves, act, dy)
            *gws, dx = torch.autograd.grad([h, act, *extra], [*weights, x], [dy, da, *d_extra], allow_unused=True)
            accumulate(grads, names, gws)
            return dx
        with torch.enable_grad():
            h = self.attn(leaves, x, rope, cfg, mask)
        dh = torch.empty_like(dy)
        for a, b in self._chunks(x.shape[1]):
            hc = h.detach()[:, a:b].requires_grad_(True)
            chunk = rows(leaves, a, b)
            with torch.enable_grad():
                act = self.mlp_act(chunk, hc, cfg)
            da = down_backward(leaves, grads, act.detach(), dy[:, a:b])
            extra, d_extra = down_adapter(chunk, act, dy[:, a:b])
            *gws, dhc = torch.autograd.grad([act, *extra], [*weights, hc], [da, *d_extra], allow_unused=True)
            dh[:, a:b] = dhc + dy[:, a:b]  # and the residual's share
            del act, da, dhc
            accumulate(grads, names, gws)
        *gws, dx = torch.autograd.grad(h, [*weights, x], dh, allow_unused=True)
        accumulate(grads, names, gws)
        return dx


ATTENTION_SCRATCH_DEVICES = ("cuda",)
"""Devices whose attention backward kernel takes the scratch :func:`tiled_backward_bytes` counts."""


def tiled_backward_bytes(cfg, tokens: int, rows: int, itemsize: int, compiled: bool, device: str) -> int:
    """Peak bytes of :meth:`LayerRunner.backward` for a tiled dense layer over one micro-batch of
    ``tokens`` tokens in MLP chunks of ``rows`` rows (all its sequences' chunks), compute dtype of
    ``itemsize`` bytes, eager or ``compiled``: beside the layer's input, its output gradient dy, its
    weights and their fp32 gradient buffer, which are counted elsewhere. The largest of its moments:

    - an MLP chunk's backward: the attention half's graph (what its autograd saves: the fused q/k/v
      output, the rotated q and k, the attention output, the log-sum-exp per head, and the input
      norm's, eager its fp32 upcast of a 16-bit input, normalised value and product with the weight,
      compiled its reciprocal RMS only, and its output too where the lean partitioner is absent),
      the half's output h and its gradient dh, and per chunk row the post-attention norm's (4H +
      2cH) and the MLP's seven [rows, intermediate] tensors (gate/up, silu(gate), the activation,
      its gradient from the down projection, the gradients of silu(gate) and up, gate/up's);
    - the attention's backward: the graph, h and dh, the gradient of the attention output, those of
      q, k and v and, on CUDA, the kernel's scratch: FlashAttention-2's (torch's choice on an H200;
      counted whatever the backend) holds an fp32 dq accumulator and an fp32 row sum per query head,
      and with grouped-query attention dk and dv for every query head before they are summed per
      group, ``heads x (4d + 4 + 2cd)`` bytes per token: the 28.11 GiB a 1,048,576-token backward
      at the Qwen2.5-7B width asked for on the H200;
    - eager, the input norm's backward, the attention's graph freed: h, dh and six fp32 [S, H]
      temporaries (five where the input is fp32, its upcast being itself).

    tests/test_plan_working_set.py checks the figure against every tensor the CPU run allocates.
    """
    c, h, inter = itemsize, cfg.hidden_size, cfg.intermediate_size
    heads, d = cfg.num_attention_heads, cfg.head_size
    q, kv = heads * d, cfg.num_key_value_heads * d
    lean = compiled and lean_partitioner() is not None
    norm = 4 + (0 if lean else c * h) if compiled else (4 * h if c < 4 else 0) + 2 * c * h + 4
    graph = tokens * (c * (q + 2 * kv) + c * (q + kv) + c * q + 4 * heads + norm)
    held = tokens * 2 * c * h
    mlp = rows * ((4 * h if c < 4 else 0) + 2 * c * h + 7 * c * inter)
    scratch = heads * (4 * d + 4 + (2 * c * d if kv != q else 0)) if device in ATTENTION_SCRATCH_DEVICES else 0
    attention = tokens * (c * q + c * (q + 2 * kv) + scratch)
    norm_backward = 0 if compiled else tokens * (6 if c < 4 else 5) * 4 * h
    return max(graph + held + max(mlp, attention), held + norm_backward)


def layer_backward(runner: LayerRunner, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
                   inputs: list[torch.Tensor], dx: list[torch.Tensor], contexts: list[tuple], cfg,
                   dropout: Callable[[int], dict[str, torch.Tensor]] | None = None) -> None:
    """Recompute one layer per micro-batch from its checkpoint and backpropagate through it.

    runner: how the layer runs (tiled or not, compiled or not; :mod:`megatrain_ray.engine.compute.sequence`);
    params: the layer's views into its device slot (and, in a LoRA run, its adapters beside them);
    grads: views into the fp32 gradient buffer of what trains (the same names; a LoRA run's adapters
    only), accumulated into; inputs, dx: M x [B, S, H] checkpoints and output gradients, the latter
    replaced by the input gradients; contexts: M x (rope, mask); dropout: micro-batch m's adapter
    dropout masks (:func:`~megatrain_ray.model.lora.dropout_masks`), or None. Each parameter is its own autograd
    leaf (a view of the slot, no copy), so its gradient is added straight into its place in the flat
    buffer rather than assembled into a whole-layer gradient first.
    """
    leaves = trainable_leaves(params, grads)
    for m, x in enumerate(inputs):
        dx[m] = runner.backward(with_dropout(leaves, dropout, m), grads, x, dx[m], contexts[m], cfg)


def routed_backward(runner: LayerRunner, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
                    inputs: list[torch.Tensor], dx: list[torch.Tensor], contexts: list[tuple], cfg, routing,
                    layer: int, dropout: Callable[[int], dict[str, torch.Tensor]] | None = None) -> None:
    """:func:`layer_backward` for sparse decoder layer ``layer``; routing: the step's
    :class:`~megatrain_ray.engine.compute.routing.StepRouting`, which gives each micro-batch's gradient of the
    load-balancing loss with respect to the router probabilities and the experts the forward chose;
    contexts: M x (rope, mask, tokens) (:attr:`MicroBatches.routed_ctx`)."""
    leaves = trainable_leaves(params, grads)
    for m, x in enumerate(inputs):
        dx[m] = runner.backward_routed(with_dropout(leaves, dropout, m), grads, x, dx[m], contexts[m], cfg,
                                       routing.prob_grad(m), routing.chosen(layer, m))


class CompiledLayer:
    """:func:`~megatrain_ray.model.transformer.decoder_layer` through ``torch.compile``, one compiled graph for
    every layer (same shapes), fusing the elementwise work (RMSNorm, RoPE, SwiGLU, residuals) around
    the GEMMs and attention, forward and backward. If compiling fails (no Triton, an unsupported
    GPU, a compiler bug) the run goes on eagerly, with one warning, rather than dying at step 1.
    The LM head's chunk loss (:func:`~megatrain_ray.engine.compute.head.chunk_loss_sum`) is compiled through
    it too (``what``: the name in the warning).

    The training graph (gradients on: a kept forward, a recompute) is partitioned under
    ``partitioner``: torch._functorch.config settings, None for torch's own, or "lean" (the
    default) for :func:`~megatrain_ray.engine.compute.activations.lean_partitioner`'s, which save less for
    the backward and recompute the difference there, elementwise work only (torch's own where this
    torch lacks them). They are applied around calls with gradients on only, so the no-grad
    forward's graph is compiled as before; Dynamo does not guard on them, so they cause no
    recompile (and every training call runs under the same ones).
    """

    def __init__(self, backend: str | object = "inductor", warn=print, threads: int = 1, fn=decoder_layer,
                 what: str = "decoder layer", backward_at_forward: bool = False,
                 partitioner: dict | str | None = "lean"):
        import torch._inductor.config

        torch._inductor.config.compile_threads = threads  # 1: no worker pool (its host memory)
        self.fn = fn  # decoder_layer, or one of its halves when the MLP is tiled (engine.compute.sequence)
        self.compiled = torch.compile(fn, dynamic=False, backend=backend)
        import torch._functorch.config as functorch_config

        self.training_config = dict((lean_partitioner() if partitioner == "lean" else partitioner) or {})
        """torch._functorch.config settings of the calls with gradients on: the partitioner's, and with
        ``backward_at_forward`` the backward graph compiled in the forward call (AOTAutograd lowers it
        lazily, at the first backward, by default), so that its failure too is caught here and the
        call runs eagerly; the LM head (:mod:`megatrain_ray.engine.compute.head`) differentiates every call at once."""
        if backward_at_forward and hasattr(functorch_config, "force_non_lazy_backward_lowering"):
            self.training_config["force_non_lazy_backward_lowering"] = True
        self.failure: BaseException | None = None
        self.warn = warn
        self.what = what

    def release_workers(self) -> None:
        """Shut Inductor's compile worker pool down (after the first step, once both graphs are
        compiled); a later recompile would start it again."""
        try:
            from torch._inductor.async_compile import shutdown_compile_workers
        except ImportError:
            return
        shutdown_compile_workers()

    def __call__(self, *args):
        if self.failure is None:
            try:
                if self.training_config and torch.is_grad_enabled():
                    import torch._functorch.config as functorch_config

                    with functorch_config.patch(**self.training_config):
                        return self.compiled(*args)
                return self.compiled(*args)
            except torch._dynamo.exc.BackendCompilerFailed as e:  # failed while compiling, not running
                self.failure = e
                cause = getattr(e, "inner_exception", None) or e
                self.warn(f"warning: torch.compile of the {self.what} failed ({type(cause).__name__}: "
                          f"{str(cause).splitlines()[0] if str(cause) else ''}); "
                          "running it eagerly (set compute.compile=false to skip the attempt).")
        return self.fn(*args)


def attention_mask(position_ids: torch.Tensor, window: int | None = None):
    """position_ids: [B, S] on the device -> the mask :func:`~megatrain_ray.model.transformer.attention`
    takes for packed documents, limited to ``window`` positions (None: no limit): a FlexAttention
    ``BlockMask`` on CUDA, else a dense [B, 1, S, S] bool."""
    if position_ids.device.type != "cuda":
        return document_mask(position_ids) if window is None else window_mask(
            position_ids.shape[-1], window, position_ids.device, position_ids)
    from torch.nn.attention.flex_attention import create_block_mask

    doc = document_ids(position_ids)
    b, s = position_ids.shape
    span = s if window is None else window

    def same_document_causal(bi, hi, qi, ki):
        return (qi >= ki) & (qi - ki < span) & (doc[bi, qi] == doc[bi, ki])

    return create_block_mask(same_document_causal, b, None, s, s, device=position_ids.device, _compile=True)


def step_contexts(cfg, position_ids: torch.Tensor | None, num_mb: int, seq: int, device, dtype,
                  window: int | None = None) -> list[tuple]:
    """(rope, mask) of each of the step's ``num_mb`` micro-batches, made once per step, shared by all
    layers (of one attention span: ``window`` positions for sliding-window layers, None for full).

    position_ids: [M, B, S] (positions within each token's document) or None (one document per
    sequence: one [S, d] RoPE table for all, causal attention: mask None where neither a window nor
    sinks on CUDA ask for one).
    """
    if position_ids is None:
        rope = rope_cache(cfg, seq, device, dtype)
        if window is None and not (cfg.attention_sinks and torch.device(device).type == "cuda"):
            return [(rope, None)] * num_mb
        mask = attention_mask(torch.arange(seq, device=device)[None], window)
        return [(rope, mask)] * num_mb
    table = rope_cache(cfg, int(position_ids.max()) + 1, device, dtype)
    return [(rope_at(table, pos), attention_mask(pos, window)) for pos in position_ids]


@dataclass(frozen=True)
class MicroBatches:
    """A step's micro-batches on the device, with what every layer of the step shares."""

    ids: torch.Tensor
    """[M, B, S] token ids."""
    labels: torch.Tensor
    """[M, B, S] labels (IGNORE_INDEX where not counted)."""
    ctx: list
    """Each micro-batch's (rope, mask) (:func:`step_contexts`)."""
    n_tokens: int
    """Counted tokens of the whole batch (every worker's share): what the loss is the mean over."""
    tokens: list
    """Each micro-batch's attention mask [B, S] bool (False: padding), or None where the batch has
    none (no padding): what the router statistics of a sparse layer count, as transformers' do."""
    windowed: list | None = None
    """Each micro-batch's (rope, mask) for the sliding-window layers, or None (the model has none)."""
    sliding: frozenset = frozenset()
    """The decoder layers that take :attr:`windowed` (``cfg.window(i)`` set)."""

    @property
    def routed_ctx(self) -> list[tuple]:
        """Each micro-batch's (rope, mask, tokens): a sparse layer's context."""
        return [(rope, mask, tokens) for (rope, mask), tokens in zip(self.ctx, self.tokens)]

    def ctx_of(self, layer: int) -> list[tuple]:
        """Each micro-batch's (rope, mask) for decoder layer ``layer``."""
        return self.windowed if layer in self.sliding else self.ctx

    def routed_ctx_of(self, layer: int) -> list[tuple]:
        """Each micro-batch's (rope, mask, tokens) for sparse decoder layer ``layer``."""
        return [(rope, mask, tokens) for (rope, mask), tokens in zip(self.ctx_of(layer), self.tokens)]

    @classmethod
    def of(cls, cfg, batch: dict, device, dtype, share: tuple[int, int] | None = None,
           seq: int | None = None) -> MicroBatches:
        """batch: input_ids, labels (and position_ids for packed documents, attention_mask for padded
        rows): [M, B, S]; ``share``:
        (rank, world) to take that worker's equal share of the micro-batches; ``seq``: the length the
        sequences must have (a validation batch beside the training one)."""
        ids = torch.tensor(batch["input_ids"], dtype=torch.long)
        labels = torch.tensor(batch["labels"], dtype=torch.long)
        pos = batch.get("position_ids")  # packed documents (data.pack_documents), else absent
        pos = None if pos is None else torch.tensor(pos, dtype=torch.long)
        keep = batch.get("attention_mask")  # padded rows, else absent
        keep = None if keep is None else torch.tensor(keep, dtype=torch.bool)
        n_tokens = max(1, int((labels != IGNORE_INDEX).sum()))  # of the whole step: every worker's share
        if seq is not None and ids.shape[2] != seq:
            raise PipelineError(f"validation sequences have {ids.shape[2]} tokens but training ones {seq}.")
        if share is not None:
            rank, world = share
            n = ids.shape[0] // world
            ids, labels, pos, keep = (t if t is None else t[rank * n:(rank + 1) * n] for t in (ids, labels, pos, keep))
        ids, labels = ids.to(device), labels.to(device)
        pos = None if pos is None else pos.to(device)
        ctx = step_contexts(cfg, pos, ids.shape[0], ids.shape[2], device, dtype)
        tokens = [None] * ids.shape[0] if keep is None else list(keep.to(device))
        sliding = frozenset(i for i in range(cfg.num_hidden_layers) if cfg.window(i) is not None)  # one span
        windowed = step_contexts(cfg, pos, ids.shape[0], ids.shape[2], device, dtype, cfg.sliding_window) if sliding else None
        return cls(ids, labels, ctx, n_tokens, tokens, windowed, sliding)
