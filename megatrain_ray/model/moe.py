"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral, Qwen2-MoE, GLM-4.5, gpt-oss), architecture only: pure
functions of (weights, inputs), as transformers' ``*SparseMoeBlock`` / ``Glm4MoeMoE`` / ``GptOssMLP`` compute them.

A sparse layer's MLP is a router and E routed experts (each a SwiGLU MLP of width
``cfg.expert_size``), plus, for Qwen2-MoE, a shared expert every token goes through, scaled by a
sigmoid gate, and for GLM-4.5 an ungated one (``cfg.shared_expert_size`` wide). The router is the
one ``cfg.router_scoring`` names (:func:`route`, :data:`ROUTES`):

- ``softmax`` (Qwen, Mixtral; :func:`softmax_route`): per token the router's logits [E], their
  softmax in fp32, the top-k experts and their probabilities (renormalised to sum to 1 with
  ``norm_topk_prob``: Mixtral always, Qwen per config), cast to the activations' dtype;
- ``sigmoid`` (GLM-4.5, as DeepSeek-V3; :func:`grouped_route`): the logits in fp32 (the input and
  the router weight upcast, as transformers computes them), scores = their sigmoid. The router's
  *score-correction bias* ``mlp.gate.e_score_correction_bias`` [E] is added to the scores for the
  choice only: the experts' ``n_group`` groups are ranked by the sum of their two best biased
  scores, the best ``topk_group`` groups kept, and the top-k experts among them taken by biased
  score. The weights are the unbiased scores of the chosen experts (renormalised with
  ``norm_topk_prob``) times ``routed_scaling_factor``. The bias is how GLM balances its experts'
  load (adjusted during its pretraining outside the gradient, which is why there is no auxiliary
  loss): here it is held *frozen*, a parameter of the layer that is loaded, saved and exported
  with the others and never changed by training. It reaches the output only through integer
  indices, so its gradient is exactly zero, its AdamW moments stay zero and AdamW's update of it is
  exactly zero; it is a 1-D parameter, so weight decay reaches it only with
  ``optim.decay_norms_and_biases``, which a glm4_moe run refuses (tests/test_glm_moe.py trains and
  checks it bit for bit).

The token's output is the weighted sum of its k experts' outputs (:func:`sparse_mlp`).

Weights, named relative to the layer as on the Hub (one tensor per expert; :func:`names`):
``mlp.gate.weight`` [E, H] (the router), ``mlp.experts.{e}.gate_proj.weight`` / ``up_proj`` [I, H]
and ``down_proj`` [H, I]; Mixtral's are ``block_sparse_moe.gate.weight`` and
``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2`` (down); Qwen2-MoE also has
``mlp.shared_expert.{gate,up,down}_proj.weight`` and ``mlp.shared_expert_gate.weight`` [1, H]; GLM-4.5
``mlp.gate.e_score_correction_bias`` [E] and ``mlp.shared_experts.{gate,up,down}_proj.weight`` (:class:`Names`). As
with the projection groups of :mod:`megatrain_ray.model.transformer`, the caller may also pass the
experts *stacked*, as transformers 5 holds them: ``{mlp}.experts.gate_up_proj`` [E, 2I, H] (each
expert's gate and up weights, stacked along dim 1) and ``{mlp}.experts.down_proj`` [E, H, I]. Then
those are used, with no copy (the engine's flat layout offers them as views, see
:meth:`megatrain_ray.model.layout.LayerTemplate.bind`); else the per-expert tensors are stacked
here (a copy per call). Same values either way.

Compute: the k x N (token, expert) pairs are sorted by expert (a stable sort: within an expert the
tokens keep their order), the tokens gathered in that order, and each expert's GEMMs run over its
contiguous rows: on a GPU as one grouped GEMM per projection (torch's ``grouped_mm``, where torch and
the GPU support it: bf16 on compute capability 8.0+ from torch 2.9, 9.x before), with no Python loop
over experts and no host synchronisation; elsewhere one GEMM per expert over its rows (:func:`grouped_linear`, the CPU
path; same values). An expert that receives no token has zero rows, so its gradient is exactly zero.
The outputs return to token order through the inverse permutation and the k weighted outputs of
each token are summed in a fixed order (no atomics, deterministic).
A recompute of the layer (the engine's backward) may be given the experts its forward chose
(``chosen``): the router's probabilities are computed again and the weights taken at those experts,
so bits that differ between the two runs move no token to another expert.

Adapters (LoRA) on the routed experts, as PEFT's ``target_parameters`` puts them on transformers'
stacked parameters: where the params hold ``{mlp}.experts.gate_up_proj.lora_A.weight`` [E, r, H]
and ``.lora_B.weight`` [E, 2I, r] (likewise for down_proj: [E, r, I], [E, H, r]), each expert's
rows get scaling * B_e (A_e x) beside W_e x, through two more grouped GEMMs of rank r
(:func:`grouped_low_rank`); the shared expert's projections take a dense adapter each.

The load-balancing auxiliary loss (Switch Transformer, as transformers' ``load_balancing_loss_func``
computes it given the attention mask): over every sparse layer's rows of a micro-batch together,
f_e = (number of top-k assignments to expert e) / rows and P_e = (sum of the router's softmax
probabilities of e) / rows, rows = tokens x sparse layers, where only the tokens the attention mask
keeps count (``tokens``: padding is routed and computed like any token, but stays out of f, P and
rows; no mask: every token counts); loss = E x sum_e f_e P_e. f is a count,
not differentiable; P is. Each layer contributes its own counts and probability sums
(:class:`RouterStats`), so a caller that runs the layers one at a time (the engine) adds them up,
and :func:`aux_loss` of the sums is the loss; its gradient reaches layer l only through l's P, as
E x sum_e f_e x P_l,e / rows (:func:`aux_loss_of_layer`, whose sum over layers is the loss).

Where the next routers go: :data:`ROUTES` is the one place that maps router logits to (top-k
weights, top-k indices, the probabilities the aux loss sees), one function per
``cfg.router_scoring``; the expert GEMMs, the dispatch and the shared experts are the same for
every router (DeepSeek-V3's is GLM's: its names and routing are GLM_NAMES and :func:`grouped_route`).

gpt-oss (:data:`GPT_OSS_NAMES`): the router is ``mlp.router.weight`` [E, H] with a bias
``mlp.router.bias`` [E]; its k experts are the top-k of the logits and their weights the softmax of
those k logits (transformers' ``GptOssTopKRouter``; the full softmax is still what the
load-balancing loss sees). Each expert's projections carry biases (``mlp.experts.{e}.gate_proj.bias``
[I], ``up_proj.bias`` [I], ``down_proj.bias`` [H]; the layout may offer them stacked too, as
``mlp.experts.gate_up_proj_bias`` [E, 2I] and ``mlp.experts.down_proj_bias`` [E, H]), added to each
row of the grouped GEMMs by its expert; and the activation between the two GEMMs is the clamped
SwiGLU of :func:`expert_activation` (``cfg.swiglu_limit``). The Hub stores gpt-oss's experts only
stacked, in another layout (``gate_up_proj`` [E, H, 2I] with gate and up interleaved along the last
dim, ``down_proj`` [E, I, H], or MXFP4 blocks); :mod:`megatrain_ray.io.gpt_oss` brings them into
this one at import and back at export, so the names here are this project's, not the Hub's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from .grouped import dispatch, grouped_linear, grouped_low_rank
from .linear import linear

Params = dict[str, torch.Tensor]

ATTENTION, SHARED_EXPERT, EXPERT = "attention", "shared_expert", "expert"
"""What a sparse layer's parameter belongs to (:func:`part_of`): the part every token uses (attention,
router, norms), the shared expert (with its gate), or one routed expert."""

ROUTERS = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight")
"""The router weight's name (Qwen's, Mixtral's, gpt-oss's): its presence in a layer's params makes the MLP sparse."""


@dataclass(frozen=True)
class Names:
    """The names of a sparse layer's MLP tensors in one family, relative to the layer."""

    block: str
    """``mlp`` (Qwen, GLM) or ``block_sparse_moe`` (Mixtral)."""
    projections: tuple[str, str, str]
    """An expert's gate, up and down projections: gate_proj, up_proj, down_proj, or Mixtral's w1, w3, w2."""
    shared: str = "mlp.shared_expert"
    """The shared expert's module: Qwen2-MoE's ``mlp.shared_expert``, GLM's ``mlp.shared_experts``."""
    shared_gate: str | None = "mlp.shared_expert_gate.weight"
    """The shared expert's sigmoid gate [1, H] (Qwen2-MoE's), or None: an ungated shared expert (GLM's)."""
    gate: str = "gate"
    """The router's module: ``gate`` (Qwen, Mixtral) or ``router`` (gpt-oss)."""
    biased: bool = False
    """Router and experts carry biases, and the routing weights are the softmax of the top-k logits (gpt-oss)."""

    @property
    def router(self) -> str:
        return f"{self.block}.{self.gate}.weight"

    @property
    def router_bias(self) -> str:
        """The router's bias (of a biased family)."""
        return f"{self.block}.{self.gate}.bias"

    @property
    def stacked_bias(self) -> tuple[str, str]:
        """The names the experts' stacked biases (gate_up [E, 2I], down [E, H]) may be passed under."""
        return f"{self.block}.experts.gate_up_proj_bias", f"{self.block}.experts.down_proj_bias"

    def expert_bias(self, e: int) -> tuple[str, str, str]:
        """Routed expert ``e``'s gate, up and down biases (of a biased family)."""
        return tuple(f"{self.block}.experts.{e}.{m}.bias" for m in self.projections)

    @property
    def score_bias(self) -> str:
        """The router's score-correction bias [E] (GLM's ``mlp.gate.e_score_correction_bias``)."""
        return f"{self.block}.{self.gate}.e_score_correction_bias"

    @property
    def stacked(self) -> tuple[str, str]:
        """The names the experts' stacked weights (gate_up [E, 2I, H], down [E, H, I]) may be passed under."""
        return f"{self.block}.experts.gate_up_proj", f"{self.block}.experts.down_proj"

    def expert(self, e: int) -> tuple[str, str, str]:
        """Routed expert ``e``'s gate, up and down weights."""
        return tuple(f"{self.block}.experts.{e}.{m}.weight" for m in self.projections)


QWEN_NAMES = Names("mlp", ("gate_proj", "up_proj", "down_proj"))
MIXTRAL_NAMES = Names("block_sparse_moe", ("w1", "w3", "w2"))
GLM_NAMES = Names("mlp", ("gate_proj", "up_proj", "down_proj"), shared="mlp.shared_experts", shared_gate=None)
GPT_OSS_NAMES = Names("mlp", ("gate_proj", "up_proj", "down_proj"), gate="router", biased=True)
"""gpt-oss's: the Hub's router names, and per-expert names of this project's (see the module docstring)."""
FAMILIES = (QWEN_NAMES, MIXTRAL_NAMES, GLM_NAMES, GPT_OSS_NAMES)
SHARED_MODULES = (QWEN_NAMES.shared, GLM_NAMES.shared)
"""The shared expert's module in each family that has one."""


def names(cfg: ModelConfig) -> Names:
    """The names of ``cfg``'s sparse-layer tensors (the Hub's, but for gpt-oss's experts)."""
    return {"mixtral": MIXTRAL_NAMES, "glm4_moe": GLM_NAMES, "gpt_oss": GPT_OSS_NAMES}.get(cfg.model_type, QWEN_NAMES)


def is_sparse(p: Params) -> bool:
    """Whether a layer's params describe a sparse MLP (they hold a router)."""
    return any(r in p for r in ROUTERS)


def part_of(name: str) -> tuple[str, int | None]:
    """(:data:`ATTENTION`, None), (:data:`SHARED_EXPERT`, None) or (:data:`EXPERT`, e) for a layer's
    parameter ``name`` (relative to the layer, per expert as on the Hub)."""
    if name.startswith("mlp.shared_expert"):
        return SHARED_EXPERT, None
    for block in (QWEN_NAMES.block, MIXTRAL_NAMES.block):
        head = f"{block}.experts."
        if name.startswith(head) and name[len(head):].split(".")[0].isdigit():
            return EXPERT, int(name[len(head):].split(".")[0])
    return ATTENTION, None


def sparse_params(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a sparse layer's MLP parameters: the router (with its score-correction bias
    where the routing uses one: GLM's), every expert's gate and up back to back expert after expert,
    then every expert's down (the order in which the flat layout can offer the stacked views), then
    the shared expert and its gate (Qwen2-MoE; GLM's shared experts have none)."""
    h, i, e, n = cfg.hidden_size, cfg.expert_size, cfg.num_experts, names(cfg)
    params = [(n.router, (e, h))]
    if cfg.router_scoring == "sigmoid":
        params.append((n.score_bias, (e,)))
    for j in range(e):
        gate, up, _ = n.expert(j)
        params += [(gate, (i, h)), (up, (i, h))]
    params += [(n.expert(j)[2], (h, i)) for j in range(e)]
    if n.biased:  # 1-D: the layout puts them after the matrices, in this order (stackable likewise)
        params.append((n.router_bias, (e,)))
        for j in range(e):
            gate, up, _ = n.expert_bias(j)
            params += [(gate, (i,)), (up, (i,))]
        params += [(n.expert_bias(j)[2], (h,)) for j in range(e)]
    s = cfg.shared_expert_size
    if s:
        params += [(f"{n.shared}.gate_proj.weight", (s, h)), (f"{n.shared}.up_proj.weight", (s, h)),
                   (f"{n.shared}.down_proj.weight", (h, s))]
        if n.shared_gate:
            params.append((n.shared_gate, (1, h)))
    return params


@dataclass
class RouterStats:
    """One sparse layer's contribution to the load-balancing loss of one micro-batch."""

    counts: torch.Tensor
    """[E] float32, no graph: top-k assignments of each expert (tokens routed to it, padding included:
    the rows each expert computed)."""
    prob_sum: torch.Tensor
    """[E] float32, differentiable: the sum over the counted tokens of the router's softmax probability
    of each expert."""
    rows: int | torch.Tensor
    """Tokens counted: all N without an attention mask, else those it keeps (a 0-d fp32 tensor, so
    that no host synchronisation is needed)."""
    assigned: torch.Tensor
    """[E] float32, no graph: top-k assignments of each expert from the counted tokens (the f of the
    loss; ``counts`` itself without an attention mask)."""
    experts: torch.Tensor | None = None
    """[N, k] int64, no graph: the experts each token was sent to, in top-k's order (what a recompute
    of the layer is given as ``chosen``)."""


def softmax_route(p: Params, x: torch.Tensor, cfg: ModelConfig, chosen: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The softmax top-k router (Qwen, Mixtral). x: [N, H] -> (probs [N, E] fp32, weights [N, k] in
    x's dtype, experts [N, k] int64): softmax in fp32, top-k, renormalised with ``cfg.norm_topk_prob``.
    chosen: [N, k] integer, the experts an earlier run of the layer on the same tokens chose (in
    top-k's order), or None: with it the choice is that one and its weights are these
    probabilities of those experts (a recompute whose last bits differ from its forward's cannot
    send a token elsewhere). A biased family's (gpt-oss): the router's bias added, the top-k of the
    logits, and their weights the fp32 softmax of those k logits."""
    n = names(cfg)
    logits = F.linear(x, p[n.router], p[n.router_bias] if n.biased else None)  # [N, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if n.biased:
        if chosen is None:
            top, experts = torch.topk(logits, cfg.num_experts_per_tok, dim=-1)
        else:
            experts = chosen.long()
            top = logits.gather(-1, experts)
        return probs, torch.softmax(top, dim=-1, dtype=torch.float32).to(x.dtype), experts
    if chosen is None:
        top, experts = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
    else:
        experts = chosen.long()
        top = probs.gather(-1, experts)
    if cfg.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return probs, top.to(x.dtype), experts


def grouped_route(p: Params, x: torch.Tensor, cfg: ModelConfig, chosen: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GLM-4.5's router (DeepSeek-V3's). x: [N, H] -> (scores [N, E] fp32, weights [N, k] in x's
    dtype, experts [N, k] int64). The logits in fp32 (x and the router weight upcast), scores =
    their sigmoid; the choice reads scores + the score-correction bias [E]: the experts' n_group
    groups are scored by the sum of their two best biased scores, the topk_group best groups kept,
    and the top-k experts among those taken by biased score; the weights are the *unbiased* scores
    at the chosen experts, divided by their sum (+1e-20) with norm_topk_prob, times
    routed_scaling_factor. The bias only moves the choice, through integer indices, so no gradient
    reaches it. chosen: as :func:`softmax_route` (the bias is then not read)."""
    n = names(cfg)
    scores = torch.sigmoid(F.linear(x.float(), p[n.router].float()))  # [N, E] fp32
    if chosen is None:
        biased = scores + p[n.score_bias].float()
        if cfg.topk_group < cfg.n_group:  # else every group is kept
            groups = biased.view(biased.shape[0], cfg.n_group, -1)  # [N, G, E / G]
            best = torch.topk(groups.topk(2, dim=-1)[0].sum(dim=-1), cfg.topk_group, dim=-1)[1]  # [N, topk_group]
            keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)  # [N, G]
            biased = groups.masked_fill(~keep[..., None], float("-inf")).view_as(biased)
        experts = torch.topk(biased, cfg.num_experts_per_tok, dim=-1)[1]
    else:
        experts = chosen.long()
    top = scores.gather(-1, experts)
    if cfg.norm_topk_prob:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return scores, (top * cfg.routed_scaling_factor).to(x.dtype), experts


ROUTES = {"softmax": softmax_route, "sigmoid": grouped_route}
"""The router of each ``cfg.router_scoring``."""


def route(p: Params, x: torch.Tensor, cfg: ModelConfig, chosen: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router ``cfg`` names (:data:`ROUTES`). x: [N, H] -> (probabilities or scores [N, E] fp32,
    what the load-balancing loss reads; weights [N, k] in x's dtype; experts [N, k] int64); chosen:
    [N, k], the experts of an earlier run on the same tokens, or None."""
    return ROUTES[cfg.router_scoring](p, x, cfg, chosen)


def expert_weights(p: Params, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed experts' weights stacked: (gate_up [E, 2I, H], down [E, H, I]); the stacked views
    when the params hold them, else stacked here from the per-expert tensors (a copy)."""
    n = names(cfg)
    if n.stacked[0] in p:
        return p[n.stacked[0]], p[n.stacked[1]]
    experts = [n.expert(e) for e in range(cfg.num_experts)]
    gate_up = torch.stack([torch.cat((p[g], p[u])) for g, u, _ in experts])
    return gate_up, torch.stack([p[d] for _, _, d in experts])


def expert_biases(p: Params, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A biased family's routed experts' biases stacked: (gate_up [E, 2I], down [E, H]), the stacked
    views when the params hold them, else stacked here (a copy); None for an unbiased family."""
    n = names(cfg)
    if not n.biased:
        return None
    if n.stacked_bias[0] in p:
        return p[n.stacked_bias[0]], p[n.stacked_bias[1]]
    experts = [n.expert_bias(e) for e in range(cfg.num_experts)]
    return torch.stack([torch.cat((p[g], p[u])) for g, u, _ in experts]), torch.stack([p[d] for _, _, d in experts])


def expert_activation(gate: torch.Tensor, up: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The routed experts' activation, the input of their down projection. gate, up: [T, I] -> [T, I]:
    SwiGLU silu(gate) * up, or with ``cfg.swiglu_limit`` (gpt-oss) the clamped form: gate clamped to
    at most the limit, up to [-limit, limit], (up + 1) * gate * sigmoid(swiglu_alpha * gate)."""
    if cfg.swiglu_limit is None:
        return F.silu(gate) * up
    limit = cfg.swiglu_limit
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * cfg.swiglu_alpha))


def routed_experts(p: Params, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, cfg: ModelConfig
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted sum of each token's top-k experts' SwiGLU outputs, with the experts' adapter
    terms where ``p`` holds them (:func:`grouped_low_rank`) and their biases where the family has
    them (each row its expert's: a gather by the sorted expert ids). x: [N, H]; weights, experts:
    [N, k] (from :func:`route`) -> ([N, H], the tokens routed to each expert [E] int64)."""
    n, k = experts.shape
    order, inverse, counts = dispatch(experts, cfg.num_experts)
    gate_up, down = expert_weights(p, cfg)
    biases = expert_biases(p, cfg)
    row_expert = None if biases is None else experts.reshape(-1)[order]  # [N*k]: each sorted row's expert
    gate_up_name, down_name = names(cfg).stacked
    rows = x[order // k]  # [N*k, H]: each pair's token, grouped by expert
    hidden = grouped_linear(rows, gate_up, counts)  # [N*k, 2I]
    if biases is not None:
        hidden = hidden + biases[0][row_expert]
    extra = grouped_low_rank(p, gate_up_name, rows, counts)
    gate, up = (hidden if extra is None else hidden + extra).chunk(2, dim=-1)  # [N*k, I] each
    act = expert_activation(gate, up, cfg)
    out = grouped_linear(act, down, counts)  # [N*k, H]
    if biases is not None:
        out = out + biases[1][row_expert]
    extra = grouped_low_rank(p, down_name, act, counts)
    out = out if extra is None else out + extra
    out = out * weights.reshape(-1)[order, None]
    return out[inverse].view(n, k, -1).sum(dim=1), counts  # back to (token, slot) order, slots summed


def shared_expert(p: Params, x: torch.Tensor, n: Names = QWEN_NAMES) -> torch.Tensor:
    """The shared expert of names ``n``: Qwen2-MoE's, scaled by its sigmoid gate, or GLM's, ungated;
    its projections' adapters added where ``p`` holds them (:func:`~megatrain_ray.model.linear.linear`).
    x: [N, H] -> [N, H]."""
    gate = linear(p, f"{n.shared}.gate_proj", x)
    up = linear(p, f"{n.shared}.up_proj", x)
    out = linear(p, f"{n.shared}.down_proj", F.silu(gate) * up)
    return out if n.shared_gate is None else torch.sigmoid(F.linear(x, p[n.shared_gate])) * out


def router_stats(probs: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor,
                 tokens: torch.Tensor | None) -> RouterStats:
    """A layer's :class:`RouterStats` from its routing. probs: [N, E] fp32; experts: [N, k] int64;
    counts: [E] int64 (assignments of all N tokens); tokens: [N] bool, the attention mask (True: a
    token that counts, False: padding), or None (every token counts)."""
    if tokens is None:
        return RouterStats(counts.float(), probs.sum(dim=0), probs.shape[0], counts.float(), experts)
    keep = tokens.to(torch.float32)  # [N]
    assigned = torch.zeros_like(probs[0]).scatter_add_(0, experts.reshape(-1),
                                                       keep.repeat_interleave(experts.shape[1]))
    return RouterStats(counts.float(), (probs * keep[:, None]).sum(dim=0), keep.sum(), assigned, experts)


def sparse_mlp(p: Params, x: torch.Tensor, cfg: ModelConfig, tokens: torch.Tensor | None = None,
               chosen: torch.Tensor | None = None) -> tuple[torch.Tensor, RouterStats]:
    """The mixture-of-experts MLP of a sparse layer (its input already normed). x: [..., H] ->
    ([..., H], this layer's :class:`RouterStats`); tokens: [...] bool, the attention mask of x's
    tokens (False: padding, left out of the statistics), or None; chosen: [N, k], the experts of
    an earlier run on the same tokens (:func:`route`), or None."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])  # [N, H]
    probs, weights, experts = route(p, flat, cfg, chosen)
    out, counts = routed_experts(p, flat, weights, experts, cfg)
    n = names(cfg)
    if f"{n.shared}.down_proj.weight" in p:
        out = out + shared_expert(p, flat, n)
    stats = router_stats(probs, experts, counts, None if tokens is None else tokens.reshape(-1))
    return out.reshape(shape), stats


def aux_loss_of_layer(stats: RouterStats, total_counts: torch.Tensor, total_rows: int,
                      num_experts: int) -> torch.Tensor:
    """One layer's share of the load-balancing loss, given the counted tokens' assignments of every
    sparse layer of the micro-batch (total_counts [E], the sum of their ``assigned``; total_rows =
    counted tokens x sparse layers): E x sum_e f_e x P_l,e / rows
    with f = total_counts / total_rows. Differentiable through this layer's probabilities only; the
    shares of all layers sum to :func:`aux_loss`. -> scalar fp32."""
    f = total_counts / total_rows
    return num_experts * (f * stats.prob_sum).sum() / total_rows


def aux_loss(stats: list[RouterStats], num_experts: int) -> torch.Tensor:
    """The load-balancing loss of one micro-batch from its sparse layers' stats, as transformers'
    ``load_balancing_loss_func`` given the same attention mask: E x sum_e f_e P_e. -> scalar fp32."""
    counts = torch.stack([s.assigned for s in stats]).sum(0)
    rows = sum(s.rows for s in stats)
    return sum(aux_loss_of_layer(s, counts, rows, num_experts) for s in stats)
