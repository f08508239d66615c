"""Training FLOPs of the model, in two named conventions; every TFLOPS figure we report comes from here.

- **6NT** (:func:`flops_6nt`): 6 x N x T, with N *every* (active) parameter (embedding, LM head, norms,
  biases) and T the tokens trained: the usual "6 FLOPs per parameter per token" (2 forward, 4
  backward). Simple and comparable across systems (the peers' tables use it), but it counts the
  embedding lookup as if it were a matmul and ignores attention's S x S work.
- **PaLM** (:func:`palm_model_flops`): per token, 6 x the *matmul* parameters (every decoder
  projection and the LM head, which is the embedding matrix when tied; not the embedding lookup,
  norms or biases) plus 12 x L x heads x head_dim x S for the attention scores and values, the full
  S x S matrix, not halved for causal masking (PaLM, appendix B). The basis of MFU.

Mixtures of experts count *active* parameters: a token goes through top-k of a sparse layer's E
routed experts, so 6NT's N is :func:`active_params` (every parameter less the E - k routed experts
a token skips, per sparse layer) and PaLM's matmul parameters count k routed experts, the router
and the shared expert (with its gate, where it has one) of each sparse layer. For a dense model both
are as before. GLM-4.5's score-correction bias (E per sparse layer) counts in N, as the norms do;
gpt-oss's experts' biases count with their expert in 6NT (not in PaLM's matmul parameters), and a
sliding-window layer's attention term counts the keys it attends, min(S, window), not S.

A LoRA run (lora.rank > 0) counts the FLOPs its step runs: the frozen base's weight-gradient GEMMs
are never run, so each base matmul parameter costs 4 FLOPs per token (2 forward, 2 for the input
gradient) instead of 6, and each adapter parameter 6 (:func:`lora_flops`): 6NT becomes
(4 N + 6 N_adapters) T, PaLM's (4 x matmul parameters + 6 N_adapters) T plus the same attention term.
In a mixture of experts both Ns are active ones: the routed experts' adapters count for the k
experts a token goes through (:meth:`~megatrain_ray.model.lora.AdapterLayout.active_params`).

Neither counts the recomputation of the forward in the backward pass (the usual MFU convention),
so both are *model* FLOPs, not the hardware FLOPs executed; :func:`recompute_flops` counts that
recomputation apart, in PaLM's convention (the expected step time of
:mod:`megatrain_ray.orchestration.pace` adds it). Reported side by side under the keys
of :data:`TFLOPS_KEYS` (metrics.jsonl, the Ray gauges, the benchmark's JSON).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..config import LoraSection, ModelConfig
from .lora import AdapterLayout
from .transformer import unit_names, unit_params

TFLOPS_KEYS = {"6nt": "tflops_6nt", "palm": "tflops_palm"}
"""The name each convention's TFLOP/s goes by in metrics.jsonl, the gauges and the benchmark."""


def num_params(model: ModelConfig) -> int:
    """N of 6NT: every parameter of the model (the tied embedding counted once)."""
    total = 0
    for unit in unit_names(model):
        for _, shape in unit_params(model, unit):
            n = 1
            for dim in shape:
                n *= dim
            total += n
    return total


def expert_params(model: ModelConfig) -> int:
    """Parameters of one routed expert (gate, up, down): 3 x hidden x expert width, and for gpt-oss
    its biases (2 x expert width + hidden)."""
    biases = 2 * model.expert_size + model.hidden_size if model.model_type == "gpt_oss" else 0
    return 3 * model.hidden_size * model.expert_size + biases


def active_params(model: ModelConfig) -> int:
    """Parameters a token goes through: :func:`num_params` less, in each sparse layer, the
    E - k routed experts it is not routed to. Equal to num_params for a dense model."""
    skipped = (model.num_experts - model.num_experts_per_tok) * expert_params(model)
    return num_params(model) - len(model.sparse_layers) * skipped


def matmul_params(model: ModelConfig) -> int:
    """Weights that multiply a token's activations: q/k/v/o of every layer, gate/up/down of each
    dense layer, the router, top-k routed experts and the shared expert (and its gate) of each sparse
    layer, and the LM head."""
    h, inter = model.hidden_size, model.intermediate_size
    q, kv = model.num_attention_heads * model.head_size, model.num_key_value_heads * model.head_size
    attention = h * q + 2 * h * kv + q * h
    sparse = len(model.sparse_layers)
    dense = model.num_hidden_layers - sparse
    routed = model.num_experts * h + model.num_experts_per_tok * 3 * h * model.expert_size
    s = model.shared_expert_size  # its sigmoid gate (Qwen2-MoE's) one more row of h; GLM's has none
    shared = 3 * h * s + (h if model.shared_expert_intermediate_size else 0)
    return (model.num_hidden_layers * attention + dense * 3 * h * inter + sparse * (routed + shared)
            + model.vocab_size * h)


def attended(model: ModelConfig, seq_len: int, layers: Iterable[int] | None = None) -> int:
    """The keys each query's row spans, summed over the decoder ``layers`` (None: all of them): S per
    layer, min(S, window) per sliding-window layer (L S for a model without one)."""
    layers = range(model.num_hidden_layers) if layers is None else layers
    return sum(min(seq_len, model.window(i) or seq_len) for i in layers)


def attention_flops_per_token(model: ModelConfig, seq_len: int) -> int:
    """Training FLOPs of the attention scores and values per token, 12 L S d (d = heads x head_dim):
    the full S x S matrix, as PaLM's model FLOPs count it (causal kernels skip about half); a
    sliding-window layer's S x window (:func:`attended`)."""
    return 12 * attended(model, seq_len) * model.num_attention_heads * model.head_size


def recompute_flops(model: ModelConfig, seq_len: int, tokens: int, layers: float, reforwards: float = 0) -> float:
    """Forward FLOPs the backward runs again over ``tokens`` in sequences of ``seq_len``, in PaLM's
    convention: for each of ``layers`` decoder layers recomputed from a checkpoint, per token 2 x the
    layer's projections up to the down projection (the recompute stops before it, see
    :mod:`megatrain_ray.engine.compute.sequence`) plus 4 S d for the attention scores and values (a third of
    :func:`attention_flops_per_token`'s per layer); for each of ``reforwards`` whole layer forwards
    run again within recompute spans (:mod:`megatrain_ray.engine.compute.activations`), the down projection too."""
    h, inter = model.hidden_size, model.intermediate_size
    q, kv = model.num_attention_heads * model.head_size, model.num_key_value_heads * model.head_size
    span = attended(model, seq_len) / model.num_hidden_layers  # S, or less with sliding windows
    to_down = 2.0 * (h * q + 2 * h * kv + q * h + 2 * h * inter) + 4.0 * span * q
    return (to_down * (layers + reforwards) + 2.0 * h * inter * reforwards) * tokens


def flops_6nt(model: ModelConfig, tokens: int) -> float:
    """6 x N x T: N = :func:`active_params` (every parameter a token goes through: all of a dense
    model's), T = ``tokens`` trained."""
    return 6.0 * active_params(model) * tokens


def palm_model_flops(model: ModelConfig, seq_len: int, tokens: int) -> float:
    """PaLM's model FLOPs of ``tokens`` trained tokens in sequences of ``seq_len``: per token
    6 x :func:`matmul_params` + :func:`attention_flops_per_token`."""
    return (6.0 * matmul_params(model) + attention_flops_per_token(model, seq_len)) * tokens


def lora_flops(model: ModelConfig, lora: LoraSection, seq_len: int, tokens: int) -> tuple[float, float]:
    """(6NT's, PaLM's) FLOPs of ``tokens`` trained by a LoRA run: a frozen base parameter costs 4
    per token (no weight gradient), an adapter parameter 6, both counted active (see the module docstring)."""
    adapters = AdapterLayout.build(model, lora).active_params(model)
    return ((4.0 * active_params(model) + 6.0 * adapters) * tokens,
            (4.0 * matmul_params(model) + 6.0 * adapters + attention_flops_per_token(model, seq_len)) * tokens)


def tflops(model: ModelConfig, seq_len: int, tokens: int, seconds: float,
           lora: LoraSection | None = None) -> dict[str, float]:
    """Both conventions' TFLOP/s for ``tokens`` trained in ``seconds``, under :data:`TFLOPS_KEYS`;
    ``lora``: a LoRA run's section (its FLOPs are :func:`lora_flops`)."""
    seconds = max(seconds, 1e-9)
    if lora is not None and lora.enabled:
        six, palm = lora_flops(model, lora, seq_len, tokens)
    else:
        six, palm = flops_6nt(model, tokens), palm_model_flops(model, seq_len, tokens)
    return {TFLOPS_KEYS["6nt"]: six / seconds / 1e12, TFLOPS_KEYS["palm"]: palm / seconds / 1e12}
def fmt_count(n: float) -> str:
    """A count in the unit that fits: 950, 12.3K, 5.0M, 7.6B."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"
