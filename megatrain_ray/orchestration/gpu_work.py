"""One GPU's work in a training step, by the kind of kernel that runs it, and the rate each kind
reaches on an H200: what :func:`~megatrain_ray.orchestration.pace.expected_pace` turns into the
expected step time.

:func:`step_work` counts the step's work (:class:`StepWork`) and :func:`work_parts` prices it:

- the dense GEMMs (projections, dense MLPs, routers, shared experts, the LM head, adapters; a frozen
  base's weight gradients not run) at :func:`gemm_tflops` of the model's width, with the forwards the
  backward recomputes (:func:`~megatrain_ray.engine.compute.activations.recomputed_layers`);
- attention's scores and values, the causal half of the S x S matrix: at :data:`ATTENTION_TFLOPS`
  through torch's SDPA kernels, at :data:`FLEX_ATTENTION_TFLOPS` through FlexAttention (the layers
  that take a mask on CUDA: :func:`flex_layers`);
- a mixture of experts' routed expert GEMMs: their FLOPs at :func:`expert_tflops` of the experts'
  width, plus the expert weights they read (:func:`expert_weight_bytes`) at :data:`EXPERT_WEIGHT_GBPS`
  (what makes experts with few rows each slow);
- a quantized base's dequantization, each layer twice a step, at :data:`DEQUANT_PARAMS_PER_S`;
- :data:`UNIT_PASS_S` for each unit (decoder layers, embedding, head) and micro-batch.

The rates were fitted (least largest relative error) on the recorded single-H200 runs of
benchmarks/results that tests/test_pace_recorded.py reads, or measured in those runs' timelines
where their docstrings say so; ``pytest -s tests/test_pace_recorded.py`` prints each run's step,
measured and expected, and the seconds of each part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import TrainConfig
from ..model.flops import attended, num_params
from ..model.lora import AdapterLayout
from ..model.quant_layout import bytes_per_param

GEMM_TFLOPS = 620.0
"""TFLOP/s an H200 reaches in a step's dense GEMMs (the decoder's projections, dense MLPs, routers and
the LM head, forward, backward and recompute) as the model's width grows, with the elementwise work
between them (norms, rotary embedding, activations, the loss) counted in: :func:`gemm_tflops`.
Fitted, with :data:`GEMM_HALF_WIDTH`, on the recorded H200 runs (the module docstring),
:data:`ATTENTION_TFLOPS`, :data:`UNIT_PASS_S` and the host update's turn as fitted on the same runs.
The bench's bare-GEMM probe reaches ~790 (``gemm_tflops`` in those bench-*.json)."""
GEMM_HALF_WIDTH = 200.0
"""The hidden size at which the dense GEMMs would run at half :data:`GEMM_TFLOPS`: a narrow model's GEMMs
run slower (565 TFLOP/s at 2,048, 587 at 3,584, 605 at 8,192)."""
ATTENTION_TFLOPS = 475.0
"""TFLOP/s of torch's SDPA attention kernels (scores and values, forward, backward and recompute),
counting the causal half of the S x S matrix that they compute (PaLM's convention counts all of it):
fitted on the same runs, pinned by the 7B width's 524,288- and 1,048,576-token sequences, where
attention is ~87-92% of the step."""
FLEX_ATTENTION_TFLOPS = 300.0
"""TFLOP/s of attention through FlexAttention (:func:`flex_layers`), counted as for
:data:`ATTENTION_TFLOPS`. Measured: gpt-oss-120b at 262,144 tokens a step in sequences of 4,096, every
layer recomputed, its full-attention layers' forward 25.7 ms and recompute + backward 88 ms longer
than its 128-token sliding-window layers' in the run's timeline: 113.7 ms for their 34.1 TFLOP more."""
EXPERT_TFLOPS = 340.0
"""TFLOP/s of a mixture of experts' grouped expert GEMMs over a frozen base (the routed experts' gate,
up and down projections, forward, input gradients and recompute) as the experts' width grows
(:func:`expert_tflops`), beside the time their weights take to read (:data:`EXPERT_WEIGHT_GBPS`):
fitted with it and :data:`EXPERT_HALF_WIDTH` on the LoRA runs of four shapes, Qwen3-30B-A3B,
GLM-4.5-Air, gpt-oss-20b and gpt-oss-120b, at 128 to 1,024 rows an expert a micro-batch."""
EXPERT_TRAINED_TFLOPS = 390.0
"""The same where the experts train (a full-parameter step: their weight gradients too, grouped GEMMs
whose reduced dimension is each expert's rows): fitted on the Qwen3-30B-A3B shape's full-parameter
runs (12 layers at 262,144 tokens; 36 layers with the 8-bit state at 16 and 8 micro-batches; 8 layers
at 65,536 with 5, 6 and 8 layers resident, the last GPU-bound: 98.8% busy)."""
EXPERT_HALF_WIDTH = 200.0
"""The experts' width (their intermediate size) at which their GEMMs would run at half the rate: 79% of
it at 768 (Qwen3-30B-A3B), 88% at 1,408 (GLM-4.5-Air), 94% at 2,880 (gpt-oss)."""
EXPERT_WEIGHT_GBPS = 3250.0
"""GB/s at which the expert GEMMs read the routed experts' weights, once per expert, micro-batch and
pass (:func:`expert_weight_bytes`), on top of their FLOPs' time: an expert's GEMMs over few rows are
bound by its weights. Fitted with :data:`EXPERT_TFLOPS`; the timelines say as much: gpt-oss-120b's
layer forward at 65,536 tokens (128 rows an expert) is 24 ms longer than gpt-oss-20b's (512 rows an
expert, the same FLOPs) for the 77 GB more expert weights it reads, 3.2 TB/s."""
EXPERT_TRAINED_PASS = 1.0
"""Passes over each expert's weights that its weight gradient adds where the experts train (the
gradient GEMM's output is the size of the weights)."""
UNIT_PASS_S = 0.00144
"""Seconds each unit (decoder layer, embedding, head) costs per micro-batch beyond its FLOPs (the
launches, tickets and copies of one micro-batch through one unit, forward and backward together):
fitted on the same runs (11% and 9% of the 1b's and 3b's steps: 18 and 38 units x 4 micro-batches)."""
DEQUANT_PARAMS_PER_S = 71e9
"""Parameters an H200 dequantizes per second from a quantized base into bf16, each layer twice a step
(its forward's fetch and its backward's), a span of the compute stream of its own. Measured in the
recorded runs' timelines: nf4 70-72 G/s (a Qwen3-30B-A3B layer 8.6 ms, GLM-4.5-Air's 33 ms, the 70B
shape's 12.1 ms), mxfp4 69-73 G/s (gpt-oss-120b's 46.5 ms, gpt-oss-20b's 11.3 ms); int8 is assumed alike."""


def gemm_tflops(hidden_size: int) -> float:
    """TFLOP/s of a step's dense GEMMs on an H200 for a model of ``hidden_size`` (:data:`GEMM_TFLOPS`)."""
    return GEMM_TFLOPS * hidden_size / (hidden_size + GEMM_HALF_WIDTH)


def expert_tflops(cfg: TrainConfig) -> float:
    """TFLOP/s of the routed experts' GEMMs on an H200 at their width: :data:`EXPERT_TFLOPS` over a
    frozen base (LoRA), :data:`EXPERT_TRAINED_TFLOPS` where the experts train, x width / (width +
    :data:`EXPERT_HALF_WIDTH`)."""
    width = cfg.model.expert_size
    return (EXPERT_TFLOPS if cfg.lora.enabled else EXPERT_TRAINED_TFLOPS) * width / (width + EXPERT_HALF_WIDTH)


def flex_layers(cfg: TrainConfig) -> tuple[int, ...]:
    """The decoder layers whose attention runs through FlexAttention on CUDA: every layer of a model
    with attention sinks or of a run of packed documents (a ``BlockMask`` each), else the
    sliding-window layers (:func:`~megatrain_ray.engine.compute.sequence.step_contexts`)."""
    m = cfg.model
    every = m.attention_sinks or cfg.data.pack_documents
    return tuple(i for i in range(m.num_hidden_layers) if every or m.window(i) is not None)


@dataclass(frozen=True)
class StepWork:
    """One GPU's work in a step, by the kind of kernel that runs it (see the module docstring)."""

    dense: float
    """FLOPs of the dense GEMMs: projections, dense MLPs, routers, shared experts, LM head, adapters."""
    attention: float
    """FLOPs of the attention scores and values through SDPA, the causal half of the S x S matrix."""
    experts: float
    """FLOPs of the routed experts' grouped GEMMs."""
    dequantized: float
    """Parameters a quantized base dequantizes (each layer twice a step)."""
    unit_passes: int
    """Units x micro-batches: each unit's fixed cost per micro-batch (:data:`UNIT_PASS_S`)."""
    link_bytes: float
    """Bytes the layers stream in over the link a step (each layer twice)."""
    host_updated: float
    """Parameters the host's optimizer updates a step (none in a LoRA run: its adapters stay on the GPU)."""
    resident_updated: float = 0.0
    """Parameters of the units resident on the device, updated there at the step's end."""
    flex_attention: float = 0.0
    """FLOPs of the attention scores and values through FlexAttention (:func:`flex_layers`)."""
    expert_bytes: float = 0.0
    """Bytes of routed expert weights the expert GEMMs read (:func:`expert_weight_bytes`)."""


def step_work(cfg: TrainConfig, recomputed: int, reforwarded: int = 0, resident_params: int = 0) -> StepWork:
    """The work of one GPU's step of ``cfg`` with ``recomputed`` decoder layers' forwards run again
    (up to the down projection) and ``reforwarded`` whole forwards within recompute spans, and
    ``resident_params`` parameters resident on the device (memory.resident: updated there, not by the
    host). A frozen base (LoRA) runs no weight-gradient GEMMs: 4 FLOPs per parameter per token instead of 6."""
    m, t = cfg.model, cfg.train
    tokens = t.seq_len * t.micro_batch_size * t.num_micro_batches / cfg.parallel.workers
    layers, sparse = m.num_hidden_layers, len(m.sparse_layers)
    h, q, kv = m.hidden_size, m.num_attention_heads * m.head_size, m.num_key_value_heads * m.head_size
    attn = 2 * h * q + 2 * h * kv
    mlp = 3 * h * m.intermediate_size * (layers - sparse)  # the dense layers' MLPs, all layers together
    shared = sparse * (3 * h * m.shared_expert_size + (h if m.shared_expert_intermediate_size else 0))
    router = sparse * m.num_experts * h
    routed = sparse * m.num_experts_per_tok * 3 * h * m.expert_size
    per_param = 4.0 if cfg.lora.enabled else 6.0
    adapters = AdapterLayout.build(m, cfg.lora).active_params(m) if cfg.lora.enabled else 0
    again = (recomputed + reforwarded) / layers  # share of the layers whose forward runs again
    down = reforwarded / layers  # ... with the down projection (a third of the MLP) too
    dense = tokens * (per_param * (layers * attn + mlp + shared + router + m.vocab_size * h) + 6.0 * adapters
                      + 2.0 * (again * (layers * attn + router + 2 / 3 * (mlp + shared)) + down / 3 * (mlp + shared)))
    experts = tokens * (per_param * routed + 2.0 * (again * 2 / 3 + down / 3) * routed)
    flex = flex_layers(cfg)
    per_span = tokens * q * (6.0 + 2.0 * again)  # per key a query's row spans, summed over the layers
    layer_params = num_params(m) - m.vocab_size * h * (1 if m.tie_word_embeddings else 2)
    quantized = cfg.lora.quantized
    per_byte = bytes_per_param(m, cfg.lora.base_format, torch.bfloat16)[0] if quantized else 2.0
    micro_batches = -(-t.num_micro_batches // cfg.parallel.workers)
    sdpa = (i for i in range(layers) if i not in flex)
    return StepWork(dense, per_span * attended(m, t.seq_len, sdpa), experts,
                    2.0 * layer_params if quantized else 0.0, (layers + 2) * micro_batches,
                    2.0 * layer_params * per_byte,
                    0.0 if cfg.lora.enabled else float(num_params(m) - resident_params),
                    0.0 if cfg.lora.enabled else float(resident_params),
                    per_span * attended(m, t.seq_len, flex),
                    expert_weight_bytes(cfg, micro_batches, again * 2 / 3 + down / 3))


def expert_weight_bytes(cfg: TrainConfig, micro_batches: int, recomputed: float) -> float:
    """Bytes of routed expert weights one GPU's expert GEMMs read a step of ``micro_batches``: each
    expert that gets a row of a micro-batch, in the compute dtype (2 bytes), once a micro-batch for
    each pass over it: the forward, ``recomputed`` of a forward again in the backward (its share of
    the layers recomputed, up to the down projection: 2/3 of the GEMMs), the input gradients, and
    where the experts train :data:`EXPERT_TRAINED_PASS` for their weight gradients."""
    m, t = cfg.model, cfg.train
    experts = min(m.num_experts, t.seq_len * t.micro_batch_size * m.num_experts_per_tok)
    passes = 2.0 + recomputed + (0.0 if cfg.lora.enabled else EXPERT_TRAINED_PASS)
    return len(m.sparse_layers) * micro_batches * experts * 3 * m.hidden_size * m.expert_size * 2.0 * passes


def work_parts(cfg: TrainConfig, w: StepWork, scale: float) -> tuple[tuple[str, float, float], ...]:
    """(what, its amount: FLOPs, bytes or parameters, seconds) of each kind of ``w``'s work on a GPU whose rates are
    an H200's x ``scale`` (its nominal bf16 rate over the H200's)."""
    return (("dense GEMMs", w.dense, w.dense / (gemm_tflops(cfg.model.hidden_size) * 1e12 * scale)),
            ("attention", w.attention, w.attention / (ATTENTION_TFLOPS * 1e12 * scale)),
            ("FlexAttention", w.flex_attention, w.flex_attention / (FLEX_ATTENTION_TFLOPS * 1e12 * scale)),
            ("expert GEMMs", w.experts, w.experts / (expert_tflops(cfg) * 1e12 * scale)),
            ("expert weights", w.expert_bytes, w.expert_bytes / (EXPERT_WEIGHT_GBPS * 1e9 * scale)),
            ("dequantization", w.dequantized, w.dequantized / (DEQUANT_PARAMS_PER_S * scale)))


FLOP_PARTS = ("dense GEMMs", "attention", "FlexAttention", "expert GEMMs")
"""The parts of :func:`work_parts` counted in FLOPs."""
BYTE_PARTS = ("expert weights",)
"""The parts of :func:`work_parts` counted in bytes (the others but FLOP_PARTS: in parameters)."""
