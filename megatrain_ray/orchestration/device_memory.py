"""The device-memory side of the preflight plan: the rows one GPU (or, on a CPU run, host RAM) holds
during a step, the peak they add up to (:func:`device_total`: phases that never overlap count once),
and where each decoder layer's activations go (:func:`activation_placement`, chosen from the
device's memory or set by memory.activations), and which units are resident on the device
(:func:`resolve_resident`, memory.resident). Those two choices are made once for a run, by
:func:`megatrain_ray.orchestration.resolve.resolve`; the plan then counts the rows of what it chose
(:func:`placed_rows`), and places the activations again only to ask what would fit at another
micro-batch size or context length (:func:`device_rows`). Each takes the resident units as an argument
(``resident``: unit indices; None = as an explicit memory.resident names them, none for auto),
so the plan of a run is computed from what the run resolved, never from a rewritten config. See :mod:`megatrain_ray.orchestration.preflight`
for what each row stands for and how the estimates were checked on an H200.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import TrainConfig
from ..engine.compute.activations import (HOST, KEEP, SPAN, kept_bytes_per_token, layer_modes, recompute_spans,
                                          recomputed_layers, sparse_kept_bytes_per_token)
from ..engine.compute.device_updates import COMPACT_CHUNK, COMPACT_WORK_BYTES, IN_FLIGHT, PIECE, state_bytes
from ..engine.compute.sequence import tiled_backward_bytes
from ..engine.policy import updated_on_device
from ..engine.store.host_store import StoreSpec, largest_streamed, resident_units
from ..model.flops import recompute_flops
from ..model.quant import DEQUANT_CHUNK
from ..model.quant_layout import QuantLayout
from ..model.layout import StoreLayout
from ..model.lora import AdapterLayout
from ..model.precision import resolve_precision

CUDA_CONTEXT_BYTES = 600 * 2**20
"""Device memory the CUDA context and kernels take before any tensor."""
GPU_USABLE = 0.94
"""Share of the GPU's memory the plan lets a run use (the rest: allocator slack). Measured on an
H200 (143,771 MiB; benchmarks/results/2026-12-01_h200_defaults-7b): the plan's device total came
within 1.1 GiB above the peak torch allocated in every 7B run (e.g. 132.3 planned, 131.3 allocated), and
nvidia-smi showed 133.9 GiB used at that peak (context, cuBLAS workspace and cached blocks): a plan
at 94% of the free memory leaves ~7 GiB of that GPU unused at the peak."""
AUTO_RESIDENT_LAYERS = (1, 0)
"""What memory.resident=auto tries, in order: embed_head with this many decoder layers (see
:func:`resolve_resident`)."""


@dataclass
class Row:
    """One component: where its bytes live and how many."""

    component: str
    where: str
    """"shm" (a tmpfs; also host RAM), "host" or "device"."""
    nbytes: int
    phase: str = ""
    """Device rows held only during one phase of the step ("layer": a layer's backward; "head":
    the loss), which never overlap; "" = held throughout."""


def device_total(rows: list[Row]) -> int:
    """Peak device bytes of ``rows``: those held throughout plus the largest phase."""
    phases: dict[str, int] = {}
    for r in rows:
        if r.where == "device":
            phases[r.phase] = phases.get(r.phase, 0) + r.nbytes
    always = phases.pop("", 0)
    return always + max(phases.values(), default=0)


def device_rows(cfg: TrainConfig, device: str, micro_batch_size: int, device_bytes: int | None = None,
                resident: tuple[int, ...] | None = None, host_bytes: int | None = None) -> list[Row]:
    """The device-memory components of one step at ``micro_batch_size`` (see the module docstring),
    with the activations placed as :func:`activation_counts` chooses for a device of ``device_bytes``
    and ``host_bytes`` of host RAM free for offloaded checkpoints."""
    fixed = _fixed_device_rows(cfg, device, micro_batch_size, resident)
    counts = activation_counts(cfg, device, micro_batch_size, device_bytes, device_total(fixed), host_bytes)
    return fixed[:1] + _activation_rows(cfg, device, micro_batch_size, *counts) + fixed[1:]


def placed_rows(cfg: TrainConfig, device: str, micro_batch_size: int, resident: tuple[int, ...],
                placement: tuple[str, ...], on_device: tuple[int, ...] | None = None) -> list[Row]:
    """The device-memory components of one step at ``micro_batch_size`` with the activations placed as
    ``placement`` (one mode per decoder layer, :func:`activation_placement`) has them, and the
    streamed units ``on_device`` updated on the device (None: as optim.placement names them)."""
    fixed = _fixed_device_rows(cfg, device, micro_batch_size, resident, on_device)
    counts = placement.count(KEEP), placement.count(HOST), placement.count(SPAN)
    return fixed[:1] + _activation_rows(cfg, device, micro_batch_size, *counts) + fixed[1:]


def _shape(cfg: TrainConfig, device: str, micro_batch_size: int) -> tuple[int, int, int, int]:
    """(compute dtype bytes, tokens per micro-batch, micro-batches per GPU, hidden size)."""
    c = resolve_precision(cfg.precision, device, cfg.optim.state).compute.itemsize
    return c, micro_batch_size * cfg.train.seq_len, cfg.train.num_micro_batches // cfg.parallel.workers, \
        cfg.model.hidden_size


def configured_resident(cfg: TrainConfig, resident: tuple[int, ...] | None) -> tuple[int, ...]:
    """``resident``, or where None the units an explicit memory.resident names (none for auto)."""
    return resident_units(cfg.model, cfg.memory.resident_given) if resident is None else resident


def _fixed_device_rows(cfg: TrainConfig, device: str, micro_batch_size: int,
                       resident: tuple[int, ...] | None = None, on_device: tuple[int, ...] | None = None) -> list[Row]:
    """Every device row but the activations' (the weight slots first)."""
    m = cfg.model
    c, tokens, mbs, h = _shape(cfg, device, micro_batch_size)
    precision = resolve_precision(cfg.precision, device, cfg.optim.state)
    layout = StoreLayout.build(m)
    layer_numel = layout.max_layer_numel
    head_numel = layout.templates[layout.head.index].numel
    chunk, depth = min(cfg.memory.loss_chunk_size_on(device), tokens), cfg.memory.buffer_depth_on(device)
    resident = configured_resident(cfg, resident)
    resident_numel = sum(layout.templates[i].numel for i in resident)
    # the resident decoder layers' fp32 gradients wait for the step's end; the last of them the backward
    # reaches (layer 0) is the working set's gradient at that point, so it is not counted again
    held_resident = [u.index for u in layout.layers if u.index in resident][1:]
    resident_layer_numel = sum(layout.templates[u].numel for u in held_resident)
    lora = cfg.lora
    adapters, full = AdapterLayout.build(m, lora).num_params, AdapterLayout.build(m, lora).full
    if on_device is None:  # as optim.placement names them
        on_device = () if lora.enabled else updated_on_device(len(layout.units), resident, cfg.optim.placement)
    held = layout.num_params - sum(layout.templates[u].numel for u in on_device)  # not those updated on the device
    rows = [
        *(_slot_rows(cfg, layout, depth, c, precision.compute, resident)),
        *([Row(f"{', '.join(layout.units[i] for i in resident)}: fp32 master, AdamW moments and weights "
               "(memory.resident)", "device", resident_numel * (12 + (c if c != 4 else 0)))] if resident else []),
        *([Row(f"fp32 gradients of {len(held_resident)} resident decoder layers until the step's end "
               "(memory.resident; layer 0's is the working set's)", "device", 4 * resident_layer_numel)]
          if resident_layer_numel else []),
        Row("input gradients of every micro-batch", "device", mbs * tokens * h * c),
        _layer_working_set(cfg, device, tokens, c, 0 if lora.enabled else layer_numel),  # LoRA: no base gradient
        Row(f"LoRA adapters (rank {lora.rank}, {adapters:,} parameters): fp32 master, AdamW moments and gradient"
            f"{', compute copy' if c != 4 else ''}", "device", adapters * (16 + (c if c != 4 else 0)))
        if lora.enabled else Row("embedding + head gradients (fp32)", "device", (m.vocab_size * h + head_numel) * 4),
        *([Row(f"adapter dropout masks of one micro-batch (lora.dropout {lora.dropout})", "device", tokens * c * sum(
            shape[1] for name, shape, _ in AdapterLayout.build(m, lora).templates[0].params if ".lora_A." in name))]
          if lora.enabled and lora.dropout else []),
        *([Row(f"{' and '.join(t.unit for t in full)} trained in full (lora.train_*): fp32 master, AdamW moments "
               f"and gradient{', compute copy' if c != 4 else ''}", "device",
               sum(t.param_count for t in full) * (16 + (c if c != 4 else 0)))] if full else []),
        *([Row(f"the step's gradients, held until its norm is known ({str(precision.grad).removeprefix('torch.')}, "
               "experimental.hold_grads)", "device", held * precision.grad.itemsize)]
          if held and StoreSpec.of_run(cfg, precision, device, 0, "plan", resident).hold_grads else []),
        *_device_update_rows(layout, on_device, precision.compact, c if precision.separate_stream_copy else 0),
        Row(f"loss chunk ({chunk} tokens x {m.vocab_size} logits)", "device",
            chunk * m.vocab_size * _logit_bytes(c, cfg.compute.compile_on(device)) + 3 * chunk * h * 4, "head"),
    ]
    if device == "cuda":
        rows.append(Row("CUDA context", "device", CUDA_CONTEXT_BYTES))
    return rows


def _device_update_rows(layout: StoreLayout, units: tuple[int, ...], compact_state: bool, stream: int) -> list[Row]:
    """The streamed units updated on the device (``units``): their fp32 gradients, held until the
    step's end, and the pieces of a unit's state on the device while it is updated (fp32 master and
    moments and its ``stream``-byte stream copy; the 8-bit state's master, codes and scales, and the
    compact update's temporaries)."""
    if not units:
        return []
    held = sum(layout.templates[u].numel for u in units)
    largest = min(PIECE, max(layout.templates[u].numel for u in units))
    per = max(state_bytes(compact_state, stream))
    work = [Row(f"the 8-bit update's temporaries ({COMPACT_CHUNK:,} elements at a time)", "device",
                min(COMPACT_CHUNK, largest) * COMPACT_WORK_BYTES)] if compact_state else []
    return [Row(f"gradients of the {len(units)} streamed units updated on the device (fp32, optim.placement device)",
                "device", held * 4),
            Row(f"{IN_FLIGHT} pieces of a unit's AdamW state while it is updated on the device (in, updated, out)",
                "device", int(IN_FLIGHT * largest * per)), *work]


def _logit_bytes(c: int, compiled: bool) -> int:
    """Device bytes per logit of one loss chunk at its peak (:mod:`megatrain_ray.engine.compute.head`), for a
    compute dtype of ``c`` bytes. Eager: the logits (c), their fp32 upcast and log-softmax (4 + 4, the
    latter saved for the backward) and its fp32 gradient (4). Compiled: the logits and their gradient
    in the compute dtype (2c), the fp32 softmax fused into the kernels around the two GEMMs. Checked
    on an H200 with benchmarks/head_probe.py (the Qwen2.5-7B head in chunks of 8192 tokens): 15.2 GiB
    eager and 4.5 GiB compiled above the head's inputs, gradient and outputs, where the row says 16.6
    and 5.0."""
    return 2 * c if compiled else 3 * 4 + c


def _layer_working_set(cfg: TrainConfig, device: str, tokens: int, c: int, layer_numel: int) -> Row:
    """One layer's recompute + backward for one micro-batch of ``tokens`` (compute dtype: ``c`` bytes).

    Untiled: attention half and residual stream: ~4 [tokens, hidden] tensors (normed input, output,
    their gradients) and q, k, v with the attention output and their gradients; the MLP: 5
    [tokens, intermediate] tensors (see the module docstring). Tiled (memory.mlp_chunk_size, the
    long-context path): the peak of its moments as
    :func:`~megatrain_ray.engine.compute.sequence.tiled_backward_bytes` counts them, the attention kernel's
    scratch on CUDA among them. Both: the layer's fp32 gradient with a compute-dtype weight gradient
    (``layer_numel`` elements; 0: a LoRA run's frozen base, which has none). A sparse layer (never tiled)
    instead: its tokens x top-k dispatched rows through the experts (the gathered rows, gate/up, the
    activation, the down projection's output and their gradients: 4 [rows, hidden] and 5
    [rows, expert width]), the router's fp32 probabilities [tokens, experts] (with their softmax's
    and top-k's), and the shared expert's 5 [tokens, width]; the larger of the two kinds counts.
    """
    m = cfg.model
    h, inter = m.hidden_size, m.intermediate_size
    q, kv = m.num_attention_heads * m.head_size, m.num_key_value_heads * m.head_size
    if m.sparse_layers:
        rows = tokens * m.num_experts_per_tok
        sparse = (rows * (4 * h + 5 * m.expert_size) * c + tokens * m.num_experts * 4 * 3
                  + tokens * 5 * m.shared_expert_size * c)
        if sparse > tokens * 5 * inter * c or len(m.sparse_layers) == m.num_hidden_layers:
            return Row(f"one layer's working set (one micro-batch; a sparse layer: {rows} dispatched rows)", "device",
                       tokens * (4 * h + 2 * q + 2 * kv) * c + sparse + layer_numel * (4 + c), "layer")
    mlp_chunk = cfg.memory.mlp_chunk_size_for(cfg.train.seq_len)
    if 0 < mlp_chunk < cfg.train.seq_len:
        rows = tokens // cfg.train.seq_len * mlp_chunk  # the micro-batch's sequences, one chunk each
        return Row(f"one layer's working set (one micro-batch, MLP in chunks of {mlp_chunk} tokens)", "device",
                   tiled_backward_bytes(m, tokens, rows, c, cfg.compute.compile_on(device), device)
                   + layer_numel * (4 + c), "layer")
    return Row("one layer's working set (one micro-batch)", "device",
               tokens * (4 * h + 2 * q + 2 * kv + 5 * inter) * c + layer_numel * (4 + c), "layer")


def _kept_per_token(cfg: TrainConfig, device: str, c: int) -> int:
    """Device bytes per token of one layer's kept graph: the larger of a dense layer's and, in a
    mixture of experts, a sparse layer's (its dispatched rows: tokens x top-k through the experts,
    :func:`~megatrain_ray.engine.compute.activations.sparse_kept_bytes_per_token`), of the kinds the model has."""
    m = cfg.model
    dense = len(m.sparse_layers) < m.num_hidden_layers
    return max([kept_bytes_per_token(m, c, compiled=cfg.compute.compile_on(device))] * dense
               + [sparse_kept_bytes_per_token(m, c)] * bool(m.sparse_layers))


def _activation_bytes(cfg: TrainConfig, device: str, micro_batch_size: int) -> tuple[int, int, int]:
    """Bytes of one layer's activations (all its micro-batches): (checkpoints, kept graph with its
    weight copy, pinned host buffers of offloaded checkpoints)."""
    c, tokens, mbs, h = _shape(cfg, device, micro_batch_size)
    layer_numel = StoreLayout.build(cfg.model).max_layer_numel
    per_token = _kept_per_token(cfg, device, c)
    return (mbs * tokens * h * c, mbs * tokens * per_token + layer_numel * c,
            mbs * _pinned_size(tokens * h * c))


def activation_counts(cfg: TrainConfig, device: str, micro_batch_size: int, device_bytes: int | None,
                      fixed_bytes: int, host_bytes: int | None = None) -> tuple[int, int, int]:
    """(decoder layers kept whole, checkpoints offloaded, layers in recompute spans without a
    checkpoint of their own) as memory.activations sets or, on auto, as fits.

    auto (on cuda, with the GPU's size known): the device memory the plan allows (GPU_USABLE of it)
    minus everything else (``fixed_bytes``) goes first to every layer's checkpoint and then, layer
    by layer, to keeping whole graphs instead (each saves that layer's recompute); if not even the
    checkpoints fit, the fewest layers are offloaded that make them fit (with the 3 layers' worth
    that offloading keeps in flight on the device). If the host RAM free for them (``host_bytes``,
    None: unlimited) cannot take that many either, as many as it can take are offloaded, as many
    as fit stay on the GPU, and the other layers join recompute spans (:func:`span_counts`). With
    the GPU's size unknown, nothing is kept or offloaded. A mixture of experts' layers, dense or
    sparse, are placed alike, each kept graph counted at the larger kind's bytes (:func:`_kept_per_token`).
    """
    n = cfg.model.num_hidden_layers
    counts = cfg.memory.activation_counts(device, n)
    if counts is not None:
        return counts
    if device_bytes is None or n == 0:
        return 0, 0, 0
    budget = int(device_bytes * GPU_USABLE) - fixed_bytes
    ck, kept, pinned = _activation_bytes(cfg, device, micro_batch_size)
    budget -= ck  # the last layer's output, the head's input, is on the device whatever the placement
    if n * ck <= budget:
        return min(n, (budget - n * ck) // max(1, kept - ck)), 0, 0
    host = min(n, -(-(n * ck + 3 * ck - budget) // ck))
    room = n if host_bytes is None else max(0, host_bytes) // pinned
    if host <= room:
        return 0, host, 0
    return span_counts(n, ck, budget, min(n, room)) or (0, host, 0)


def span_counts(n: int, ck: int, budget: int, host: int) -> tuple[int, int, int] | None:
    """(0, ``host``, span layers) for ``n`` layers of ``ck`` checkpoint bytes each, ``host`` of their
    checkpoints offloaded and ``budget`` device bytes for the rest: the most checkpoints on the device
    (the fewest span layers, each costing one more layer forward) such that they, the 3 offloaded
    ones in flight and a span's inputs while its backward runs (its length less one) fit; None if
    none do."""
    for on_device in range(n - host, -1, -1):
        ckpts = on_device + host
        if ckpts == 0:
            break
        longest = -(-n // ckpts)
        if (on_device + (3 if host else 0) + longest - 1) * ck <= budget:
            return 0, host, n - ckpts
    return None


def _activation_rows(cfg: TrainConfig, device: str, micro_batch_size: int, keep: int, host: int,
                     span: int = 0) -> list[Row]:
    c, tokens, mbs, h = _shape(cfg, device, micro_batch_size)
    ck, kept, pinned = _activation_bytes(cfg, device, micro_batch_size)
    n = cfg.model.num_hidden_layers
    on_device = n - keep - host - span + 1  # + the last layer's output
    rows = [Row(f"activation checkpoints ({on_device} x {mbs} x {tokens} tokens x {h})", "device", on_device * ck)]
    if span:
        longest = -(-(n - keep) // (n - keep - span))
        rows.append(Row(f"recompute spans: {span} layers without a checkpoint, a span's inputs during its backward "
                        f"({longest - 1} x {mbs} x {tokens} tokens x {h})", "device", (longest - 1) * ck))
    if keep:
        per_token = _kept_per_token(cfg, device, c)
        rows.append(Row(f"activations kept whole ({keep} layers x {mbs} x {tokens} tokens x {per_token} B, "
                        "+ weights): no recompute", "device", keep * kept))
    if host:
        rows += [Row(f"activation checkpoints ({host} x {mbs} x {tokens} tokens x {h}), offloaded "
                     "(pinned buffers round up to powers of 2)", "host", host * pinned),
                 Row(f"activation checkpoints in flight (3 x {mbs} x {tokens} tokens x {h})", "device", 3 * ck)]
    return rows


def resolve_resident(cfg: TrainConfig, device: str, device_bytes: int | None) -> int | None:
    """memory.resident as a run on ``device`` with a GPU of ``device_bytes`` resolves it, as the
    decoder layers resident besides the embedding and the head (None: no unit resident; see
    :func:`megatrain_ray.config.execution.describe_resident`): a given setting as it is; auto made
    concrete.

    On one CUDA compute worker with fp32 master weights and moments: the first of
    :data:`AUTO_RESIDENT_LAYERS` with which the plan fits the GPU with every activation checkpoint on
    it (none offloaded to host memory). Measured at 7B on an H200: the host update of the embedding,
    layer 0 and the head is ~0.2 s a step that the GPU waits at the step boundary, more than the two
    kept layers' recompute the resident states take the memory of. Else (a LoRA run among them: its
    base has no optimizer) none. The resolved run grows auto's first fit where the host's update
    paces the step (:func:`~megatrain_ray.orchestration.resolve.resolve`, with :func:`resident_fits`).
    """
    if cfg.memory.resident != "auto":
        return cfg.memory.resident_given
    if (device == "cuda" and not cfg.lora.enabled and cfg.parallel.workers == 1 and device_bytes
            and cfg.precision.master_dtype == "float32" and cfg.optim.state == "fp32" and cfg.model.num_hidden_layers > 0):
        for layers in AUTO_RESIDENT_LAYERS:
            if resident_fits(cfg, device, device_bytes, layers):
                return layers
    return None


def resident_fits(cfg: TrainConfig, device: str, device_bytes: int, layers: int) -> bool:
    """Whether the plan fits a GPU of ``device_bytes`` with the embedding, the head and the first
    ``layers`` decoder layers resident, every activation checkpoint on the GPU (none offloaded)."""
    rows = device_rows(cfg, device, cfg.train.micro_batch_size, device_bytes, resident_units(cfg.model, layers))
    offloaded = any(r.where == "host" for r in rows)  # checkpoints pushed out to host memory
    return not offloaded and device_total(rows) <= device_bytes * GPU_USABLE


def activation_placement(cfg: TrainConfig, device: str, device_bytes: int | None,
                         resident: tuple[int, ...] | None = None, host_bytes: int | None = None,
                         on_device: tuple[int, ...] | None = None) -> tuple[str, ...]:
    """Each decoder layer's activation placement (:func:`megatrain_ray.engine.compute.activations.layer_modes`)
    for the run's micro-batch on a device of ``device_bytes`` (None: unknown; nothing is kept or
    offloaded then unless memory.activations says so), with ``host_bytes`` of host RAM free for
    offloaded checkpoints (None: unlimited), beside the streamed units ``on_device`` updated on the
    device (None: as optim.placement names them)."""
    mbs = cfg.train.micro_batch_size
    fixed = device_total(_fixed_device_rows(cfg, device, mbs, resident, on_device))
    return layer_modes(cfg.model.num_hidden_layers, *activation_counts(cfg, device, mbs, device_bytes, fixed, host_bytes))


def _pinned_size(nbytes: int) -> int:
    """What torch's pinned host allocator takes for a buffer of ``nbytes`` (the next power of 2)."""
    return 1 << max(0, nbytes - 1).bit_length()




def span_note(cfg: TrainConfig, modes: tuple[str, ...], step_flops: float) -> str:
    """What the recompute spans of ``modes`` cost, for the plan's activation line: the layer forwards
    they run again, in FLOPs and as a share of the rest of the step's ``step_flops`` (with them)."""
    spans = recompute_spans(modes)
    again = recomputed_layers(modes)[1]
    t = cfg.train
    extra = recompute_flops(cfg.model, t.seq_len, t.seq_len * t.micro_batch_size * t.num_micro_batches /
                            cfg.parallel.workers, 0, again)
    return (f"; {modes.count('span')} more have no checkpoint of their own, neither the GPU nor host RAM holding "
            f"every layer's: {len(spans)} recompute spans of up to {max(b - a + 1 for a, b in spans)} layers rerun "
            f"{again} layer forwards in the backward (+{extra / 1e15:,.1f} PFLOP, "
            f"+{extra / (step_flops - extra):.0%} of the step's)")


def activation_note(cfg: TrainConfig, device: str, result) -> str:
    """The activation placement the run gets, one line (layers kept whole / checkpointed on the
    device / offloaded / in recompute spans, and what each takes) of a
    :class:`~megatrain_ray.orchestration.preflight.MemoryPlan`."""
    rows = [r for r in result.rows if r.component.startswith("activation")]
    keep = sum(r.nbytes for r in rows if "kept whole" in r.component)
    host = sum(r.nbytes for r in rows if r.where == "host")
    modes = result.placement
    n_keep, n_host, n_span = modes.count("keep"), modes.count("host"), modes.count("span")
    n_gpu = len(modes) - n_keep - n_host - n_span
    where = "GPU" if device == "cuda" else "device"
    ckpt = sum(r.nbytes for r in rows if r.where == "device" and "kept whole" not in r.component)
    how = ("chosen by the planner from the GPU's memory" if cfg.memory.activation_counts(device, len(modes)) is None
           else f"as memory.activations={cfg.memory.activations!r} sets")
    return (f"activations ({how}): {n_keep} layers kept whole on the {where} ({fmt(keep)}, not recomputed), "
            f"{n_gpu} checkpointed on the {where} ({fmt(ckpt)} with the last layer's output"
            f"{' and those in flight' if n_host else ''}), {n_host} offloaded to host RAM ({fmt(host)})"
            + (span_note(cfg, modes, result.pace.palm + result.pace.recompute) if n_span else ""))


def fmt(n: float) -> str:
    """Bytes in binary units: 512 B, 3.0 KiB, ..., 1.2 TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def placement_line(modes: tuple[str, ...], device: str, setting: str) -> str:
    """The line a run logs at start: how many decoder layers keep their graph, their checkpoint on
    the device, or their checkpoint in host memory (``setting``: memory.activations)."""
    keep, host, span = modes.count("keep"), modes.count("host"), modes.count("span")
    where = "GPU" if device == "cuda" else "device"
    return (f"activations (memory.activations={setting}): {keep} of {len(modes)} layers kept whole on the {where}, "
            f"{len(modes) - keep - host - span} checkpointed there, {host} offloaded to host memory"
            + (f", {span} recomputed within spans from the checkpoint before them" if span else ""))


def _slot_rows(cfg, layout, depth: int, c: int, dtype, resident) -> list[Row]:
    """The weight slots: ``depth`` of the largest streamed unit; with a quantized base (lora.base_format),
    as many byte slots of its largest unit's bytes, each with a weight slot of its largest quantized unit
    (:mod:`megatrain_ray.engine.store.quantized`)."""
    if not cfg.lora.quantized:
        return [Row(f"weight slots ({depth} x largest unit{' streamed' if resident else ''})", "device",
                    depth * largest_streamed(layout, resident) * c)]
    q = QuantLayout.build(cfg.model, cfg.lora.base_format, dtype)
    numel = max((t.numel for t, u in zip(layout.templates, q.units) if not u.raw), default=1)
    return [Row(f"byte slots of the {cfg.lora.base_format} base ({depth} x largest unit)", "device",
                depth * q.largest(range(len(layout.units)))),
            Row(f"weight slots ({depth} x largest layer, dequantized)", "device", depth * numel * c),
            Row("dequantization temporaries (one chunk's fp32 values and indices)", "device", DEQUANT_CHUNK * 16)]
