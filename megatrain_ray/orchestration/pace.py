"""The pace a run should keep: its expected step time, and the queue timeouts that follow from it.

On a GPU the step time is the step's work by the kind of kernel that runs it, over the rate each
kind reaches on an H200 (:mod:`~megatrain_ray.orchestration.gpu_work`: the dense GEMMs, attention
through SDPA and through FlexAttention, the routed experts' GEMMs and the weights they read, a
quantized base's dequantization, a fixed cost per unit and micro-batch), scaled by the GPU's nominal
bf16 rate (:data:`NOMINAL_TFLOPS`, or the one ``megatrain-ray plan --gpu-tflops`` gives) over
:data:`REFERENCE_TFLOPS`; in a full-parameter run, plus :data:`HOST_PARAM_S` per parameter the host
updates (the host update's turn) and :data:`RESIDENT_PARAM_S` per parameter resident on the GPU
(their update there); and never less than the layers' streamed bytes over the link
(:data:`LINK_GBPS`). The PaLM model FLOPs (:mod:`megatrain_ray.model.flops`) and the recomputed ones
are printed beside it. The rates were fitted (least largest relative error) or measured on the
recorded single-H200 runs of benchmarks/results that tests/test_pace_recorded.py reads (dense,
long-context, mixture-of-experts, 8-bit, LoRA and quantized-base runs: ``pytest -s
tests/test_pace_recorded.py`` prints them, measured and expected, with the seconds of each part);
each prediction is within 10% of its run's step. The largest (9.5-9.9%) bound one another: the same
7B step measured 5.35 to 6.52 s on different commits, and the 7B width's short steps fall on both
sides (-9.9% to +9.5%). On the CPU, :data:`CPU_TFLOPS_PER_CORE` per usable core, plus
:data:`CPU_UNIT_S` for each unit the step passes through: the fixed cost of its fetch, tickets and
small GEMMs, which is most of a small model's step. It is an estimate to plan by, and a bound for
the timeouts:

every queue of the pipeline carries messages every step, so no wait for the next message should
last longer than a step. Whether the run is stalled is the health check's verdict alone
(:class:`~megatrain_ray.orchestration.health.Health`), from evidence of no progress: no message
moved on a node's queues for :func:`stall_s` (:data:`WAIT_STEPS` expected step times, never less
than cluster.actor_timeout_s, the floor: a checkpoint's write pauses the updates, see that field).
A role's own wait for a message (:func:`role_wait_s`) lasts twice that, and on Ray's queues ends
only when no message at all moved between the node's roles for that long
(:class:`~megatrain_ray.orchestration.queues.QueueHost`): a slow run that progresses is not stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import TrainConfig, usable_cpus
from ..model.flops import flops_6nt, lora_flops, palm_model_flops, recompute_flops
from .gpu_work import BYTE_PARTS, FLOP_PARTS, UNIT_PASS_S, step_work, work_parts

HOST_PARAM_S = 1.735e-11
"""Seconds per parameter the host's optimizer updates that a full-parameter step waits beyond its GPU
work: the gradients out, the update and the weights back in, of the units at the step's turn, which
the pipeline does not hide (the GPU is 81-99% busy in those runs, 99.8% in LoRA runs, whose adapters
stay on the GPU). Fitted on the recorded runs the module docstring names (1 / 57 G parameters per second)."""
LINK_GBPS = 55.0
"""GB/s of the host-to-GPU link each way (the H200's PCIe: h2d_gbps 53-55 in the bench-*.json of
the runs the link was busy in). A step is never shorter than its streamed bytes over it."""
REFERENCE_TFLOPS = 989.0
"""The nominal rate of the GPU the rates above were measured on (an H200's); another GPU's are
scaled by its nominal rate (or the one given) over this."""
NOMINAL_TFLOPS = (("GH200", 989.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("H800", 989.0),
                  ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0),
                  ("A10", 125.0), ("RTX 4090", 165.0))
"""(name part, dense bf16 TFLOP/s without sparsity) of known GPUs, the first part a GPU's name contains."""
DEFAULT_GPU_TFLOPS = 989.0
"""The rate assumed where the GPU is not visible or not known: an H100/H200's."""
CPU_TFLOPS_PER_CORE = 0.01
"""What one CPU core reaches in the layer's fp32 GEMMs (a conservative 10 GFLOP/s)."""
CPU_UNIT_S = 0.012
"""Seconds a step spends per unit on the CPU beyond its FLOPs (measured: the built-in tiny run, 4
units, 101 ms a step on 2 cores against 51 ms of FLOPs at the rate above)."""
WAIT_STEPS = 3
"""Expected step times a role waits for its next message before giving up (see the module docstring)."""
HOST_ADAMW_PARAMS_PER_THREAD_S = 3.25e9 / 12
"""Parameters one of the gradient sink's threads updates per second with exact AdamW, as a run keeps
it up: the sink busy 82% of a 1.632 s step for 4.36 G parameters on the H200 box's 12 AdamW threads
(pinned to CPUs 4-15; the Qwen3-30B-A3B shape at 8 layers, 65,536 tokens, the host pacing it); the
bare kernel reaches 3.9 G/s there on 16, and beside device updates the 12 threads kept up 2.6 G/s."""
HOST_COMPACT_PARAMS_PER_THREAD_S = 2.88e9 / 12
"""Parameters one of the gradient sink's threads updates per second with the 8-bit state (optim.state
8bit: the codes decoded, AdamW, the codes, scales and bf16 master weights rounded back), as a run
keeps it up: the sink busy 36% of a 19.24 s step for 20.1 G parameters on the H200 box's 12 AdamW
threads (pinned to CPUs 4-15; the 32B width at 38 layers, 65,536 tokens)."""
LINK_BOTH_GBPS = 64.0
"""GB/s of the host-to-GPU link both ways at once, for a device update's state in and out side by side
beside the streamed weights: measured, the 8-layer Qwen3-30B-A3B shape's 2 streamed units updated on
the GPU (31.2 GB of exact state in and out a step in 0.49 s of device-update time, 2026-12-03)."""
SPLIT_FIRST_PASS = 0.8
"""The share of a split update's time (an fp32 master with a bf16 stream copy, in two passes) that the
next forward waits on: its first pass, whose bytes are 24 of the two passes' 40 per parameter (the
first reads the master, the gradient and both moments, and writes the moments and the stream copy;
the second reads the master and the moments and writes the master), with what follows it before the
forward may use the unit (its stream copy over the link; the second passes of the units before it
beside it on the same threads). Fitted: the 8-layer Qwen3-30B-A3B shape with 5 of 8 layers resident
(1.19 s measured; its bytes' 0.6 would say 1.06 s)."""
RESIDENT_PARAM_S = 30 / 4.0e12
"""Seconds per parameter of the resident units' update on an H200 at the step's end (memory.resident):
AdamW in the GPU's memory, ~30 bytes a parameter (the fp32 master weights and both moments read and
written, the fp32 gradient read, the bf16 copy written) at ~4 TB/s."""
RESIDENT_TURN = "the resident units' update"
"""The name of the part of :attr:`Pace.parts` that :data:`RESIDENT_PARAM_S` counts."""
HOST_TURN = "the host update's turn"
"""The name of the part of :attr:`Pace.parts` that :data:`HOST_PARAM_S` counts."""


@dataclass(frozen=True)
class Pace:
    """One GPU's share of a step: its FLOPs and the time they should take."""

    palm: float
    """Model FLOPs, PaLM's convention (attention counted)."""
    six_nt: float
    """Model FLOPs, 6 x N x T."""
    recompute: float
    """Forward FLOPs the backward recomputes (PaLM's convention)."""
    tflops: float
    """The rate the time follows from, TFLOP/s: on the CPU, what its cores reach; on a GPU, its
    nominal (or given) rate, which scales the H200's measured rates (:data:`REFERENCE_TFLOPS`)."""
    rate_note: str
    """Where the rate comes from, for the plan's line."""
    fixed_s: float = 0.0
    """Seconds beyond the FLOPs: the units' fixed costs (:data:`CPU_UNIT_S` or
    :data:`~megatrain_ray.orchestration.gpu_work.UNIT_PASS_S` each)."""
    units: int = 0
    """Units a step passes through (what ``fixed_s`` counts; on a GPU, units x micro-batches)."""
    parts: tuple[tuple[str, float, float], ...] = ()
    """On a GPU: (what, its amount: FLOPs, bytes or parameters, seconds) of each kind of work
    (:func:`~megatrain_ray.orchestration.gpu_work.work_parts`, and the updates' turns)."""
    link_s: float = 0.0
    """On a GPU: the streamed bytes' time over the link (:data:`LINK_GBPS`)."""

    @property
    def compute_s(self) -> float:
        if self.parts:
            return sum(s for _, _, s in self.parts) + self.fixed_s
        return (self.palm + self.recompute) / (self.tflops * 1e12) + self.fixed_s

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.link_s)

    @property
    def forward_s(self) -> float:
        """The step's work before its backward sends the first gradient: its forward, a third of the
        FLOPs' and fixed costs' time (the updates' turns left out)."""
        return (self.compute_s - sum(s for what, _, s in self.parts if what in (HOST_TURN, RESIDENT_TURN))) / 3

    def line(self) -> str:
        """The plan's line: ``expected step time: ~9 min (...)``."""
        head = (f"expected step time: ~{duration(self.step_s)} ({_flop(self.palm + self.recompute)} per GPU: "
                f"{_flop(self.palm)} of the model counting attention (PaLM; 6NT: {_flop(self.six_nt)}) + "
                f"{_flop(self.recompute)} recomputed in the backward")
        if not self.parts:
            return (head + f", at {_flop(self.tflops * 1e12)}/s: {self.rate_note}"
                    + (f"; + {duration(self.fixed_s)} of fixed costs, {self.units} units x "
                       f"{duration(self.fixed_s / self.units)}" if self.fixed_s else "") + ")")
        parts = ", ".join(f"{what} {duration(s)} ({_amount(what, n)})" for what, n, s in self.parts if s)
        bound = (f"; the link, {duration(self.link_s)} for the streamed weights, is the longer"
                 if self.link_s > self.compute_s else f"; the link {duration(self.link_s)}, overlapped")
        return (head + f"; {self.rate_note}: {parts}, {duration(self.fixed_s)} for {self.units} unit x "
                f"micro-batch passes{bound})")


def _amount(what: str, n: float) -> str:
    """A part's amount of work: FLOPs, bytes or parameters (:mod:`~megatrain_ray.orchestration.gpu_work`)."""
    if what in FLOP_PARTS:
        return _flop(n)
    return f"{n / 1e9:,.0f} GB" if what in BYTE_PARTS else f"{n / 1e9:,.1f} G parameters"


def expected_pace(cfg: TrainConfig, device: str, recomputed: int, reforwarded: int = 0, tflops: float | None = None,
                  gpu_name: str | None = None, resident_params: int = 0) -> Pace:
    """The pace of ``cfg`` on ``device`` with ``recomputed`` decoder layers' forwards run again in
    the backward and ``reforwarded`` more within recompute spans (see
    :func:`~megatrain_ray.engine.compute.activations.recomputed_layers`); ``tflops``: the device's
    nominal rate (default: by ``gpu_name`` on cuda); ``resident_params``: the parameters of the units
    resident on the device (memory.resident), updated there."""
    t, m = cfg.train, cfg.model
    tokens = t.seq_len * t.micro_batch_size * t.num_micro_batches / cfg.parallel.workers
    if cfg.lora.enabled:  # no weight-gradient GEMMs for the frozen base (megatrain_ray.model.flops)
        six, palm = lora_flops(m, cfg.lora, t.seq_len, int(tokens))
    else:
        six, palm = flops_6nt(m, tokens), palm_model_flops(m, t.seq_len, tokens)
    recompute = recompute_flops(m, t.seq_len, tokens, recomputed, reforwarded)
    units = m.num_hidden_layers + 2  # the decoder layers, the embedding and the head
    if device == "cpu" and tflops is None:
        cores = usable_cpus()
        return Pace(palm, six, recompute, CPU_TFLOPS_PER_CORE * cores,
                    f"a nominal {CPU_TFLOPS_PER_CORE * 1e3:.0f} GFLOP/s per CPU core x {cores}", CPU_UNIT_S * units, units)
    if tflops is not None:
        nominal, note = tflops, f"at the H200's rates x {tflops:,.0f}/{REFERENCE_TFLOPS:,.0f} (the rate given)"
    else:
        nominal = next((r for part, r in NOMINAL_TFLOPS if gpu_name and part in gpu_name), None)
        if nominal is None:
            nominal, note = DEFAULT_GPU_TFLOPS, ("at an H200's rates (" + (f"the {gpu_name} is not in the table"
                                                 if gpu_name else "no GPU visible here") + "; --gpu-tflops sets it)")
        elif nominal == REFERENCE_TFLOPS:
            note = f"at the rates measured on an H200 (the {gpu_name}'s nominal {nominal:,.0f} bf16)"
        else:
            note = f"at an H200's rates x {nominal:,.0f}/{REFERENCE_TFLOPS:,.0f} (the {gpu_name}'s nominal bf16)"
    scale = nominal / REFERENCE_TFLOPS
    w = step_work(cfg, recomputed, reforwarded, resident_params)
    turns = ((HOST_TURN, w.host_updated, w.host_updated * HOST_PARAM_S),
             (RESIDENT_TURN, w.resident_updated, w.resident_updated * RESIDENT_PARAM_S / scale))
    parts = work_parts(cfg, w, scale) + turns
    return Pace(palm, six, recompute, nominal, note, UNIT_PASS_S * w.unit_passes, w.unit_passes, parts,
                w.link_bytes / (LINK_GBPS * 1e9))


@dataclass(frozen=True)
class UpdatePace:
    """Where a step's AdamW updates run (optim.placement) and what each path should take."""

    host_params: int
    """Parameters the gradient sink updates on the host's CPU threads."""
    host_threads: int
    """The sink's AdamW threads."""
    device_params: int
    """Parameters of the streamed units updated on the compute worker's device (optim.placement device)."""
    device_bytes_in: float
    """Bytes per such parameter copied in: fp32 master weights and two moments (the 8-bit state: bf16
    master weights, two codes and their block scales)."""
    device_bytes_out: float
    """Bytes per such parameter written back: the same, and the stream copy where the store keeps one."""
    thread_rate: float = HOST_ADAMW_PARAMS_PER_THREAD_S
    """Parameters one AdamW thread of the sink updates per second: exact AdamW's
    (:data:`HOST_ADAMW_PARAMS_PER_THREAD_S`) or the 8-bit state's (:data:`HOST_COMPACT_PARAMS_PER_THREAD_S`)."""
    held: bool = False
    """Whether the host units' gradients wait on the device for the step's norm (``StoreSpec.hold_grads``)."""
    after_norm: bool = False
    """Whether the host's updates wait for the step's norm (clipping, a sharded optimizer, or the
    gradients held): they start after the step's whole backward, in the order the next forward needs them."""
    first_pass: float = 1.0
    """The share of the host's update time the next forward waits on: its first pass where the update
    runs in two (:data:`SPLIT_FIRST_PASS`), else all of it."""
    gate_share: float = 1.0
    """The share of the next forward that runs before the last unit the host updates (the units before
    it in the forward's order, of all of them): the forward runs that far beside the host's updates."""
    device_lead: float = 0.0
    """The share of the next forward up to the last unit the device updates (first in its order)."""

    @property
    def host_s(self) -> float:
        """The host's update time per step (beside the device's step, as the updates overlap the next one)."""
        return self.host_params / (self.thread_rate * max(1, self.host_threads))

    @property
    def device_s(self) -> float:
        """The device updates' time per step: their state across the link, in and out side by side (the
        update itself, memory-bound on the device, is a small fraction of it)."""
        n, i, o = self.device_params, self.device_bytes_in, self.device_bytes_out
        return max(n * i, n * o, n * (i + o) * LINK_GBPS / LINK_BOTH_GBPS) / (LINK_GBPS * 1e9)

    def device_wait_s(self, pace: Pace) -> float:
        """What the device's updates add to its step: what they outlast the next forward over its first
        :attr:`device_lead` by (they run beside it, and it follows them)."""
        return max(0.0, self.device_s - self.device_lead * pace.forward_s)

    def step_s(self, pace: Pace) -> float:
        """The expected step time with the updates, the longer of two paths: the device's step with its
        own updates (:meth:`device_wait_s`; the units it updates leave the host update's turn,
        :data:`HOST_PARAM_S`), or the host's path (:meth:`host_path_s`)."""
        return max(pace.step_s - HOST_PARAM_S * self.device_params + self.device_wait_s(pace), self.host_path_s(pace))

    def host_path_s(self, pace: Pace) -> float:
        """The host's path of :meth:`step_s`. Updated as their gradients arrive, the host's updates start
        after the forward that comes before the backward's first gradient: the path is the forward, then
        the updates. Waiting for the step's norm (:attr:`after_norm`), they start at the backward's end,
        in the order the next forward needs the units, and that forward follows them unit by unit: the
        path is the share of the updates it waits on (:attr:`first_pass`), then the step from the last
        unit they update on (:attr:`gate_share`); and never shorter than the updates themselves, which
        the threads run one step at a time."""
        if not self.after_norm:
            return self.host_s + pace.forward_s
        after = pace.step_s - HOST_PARAM_S * self.device_params - self.gate_share * pace.forward_s
        return max(self.first_pass * self.host_s + after, self.host_s)

    def line(self, pace: Pace) -> str:
        """The plan's line on the updates."""
        host = "host none" if not self.host_params else (
                f"host {_count(self.host_params)} parameters on {self.host_threads} CPU thread(s), "
                f"~{duration(self.host_s)} at {self.thread_rate / 1e6:.0f}M parameters/s per thread, "
                + ("after the step's backward (its gradients held on the device for the norm), the next "
                   "forward following them" if self.held else
                   "after the step's backward (they wait for its norm), the next forward following "
                   + (f"their first pass ({self.first_pass:.0%} of it)" if self.first_pass < 1 else "them")
                   if self.after_norm else "beside the next step"))
        device = (f"device {_count(self.device_params)} parameters, ~{duration(self.device_s)} beside the next "
                  f"forward, which follows them over its first {self.device_lead:.0%}: "
                  f"~{duration(self.device_wait_s(pace))} added to the step "
                  f"(their state over the link: {self.device_bytes_in:.3g} bytes per parameter in and "
                  f"{self.device_bytes_out:.3g} out at "
                  f"{LINK_GBPS:.0f} GB/s each way, {LINK_BOTH_GBPS:.0f} both)")
        return f"optimizer updates: {host}; {device}; expected step time with them: ~{duration(self.step_s(pace))}"


def stall_s(pace: Pace, floor: float) -> float:
    """How long no message may move on a node's queues before the health check calls the run
    stalled: :data:`WAIT_STEPS` expected steps, at least ``floor`` (cluster.actor_timeout_s)."""
    return max(floor, WAIT_STEPS * pace.step_s)


def role_wait_s(pace: Pace, floor: float) -> float:
    """How long a role waits for its next message: twice :func:`stall_s` (and on Ray's queues only
    while no message moves at all), so that the health check's verdict comes first."""
    return 2 * stall_s(pace, floor)


def timeout_line(pace: Pace, floor: float) -> str:
    """The plan's line on the run's timeouts."""
    stall = stall_s(pace, floor)
    why = (f"{WAIT_STEPS} x the expected step time" if stall > floor else
           f"cluster.actor_timeout_s, the floor; {WAIT_STEPS} x the expected step time is "
           f"{duration(WAIT_STEPS * pace.step_s)}")
    return (f"stall check: the run is called stalled when no message moves between its roles for "
            f"{duration(stall)} ({why}); a slow step that keeps them moving is waited for")


def duration(seconds: float) -> str:
    """3 ms, 2.5 s, 42 s, 9 min, 1.5 h."""
    if seconds < 1:
        return f"{seconds * 1e3:.0f} ms"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _count(n: float) -> str:
    """1.2B, 340.5M, 12.0K."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f}{unit}"
    return f"{n:,.0f}"


def _flop(n: float) -> str:
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} FLOP"
