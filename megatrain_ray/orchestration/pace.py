"""The pace a run should keep: its expected step time, and the queue timeouts that follow from it.

The step time is the step's FLOPs per GPU over the rate the GPU reaches: the model FLOPs in PaLM's
convention (attention's S x S work counted, :mod:`megatrain_ray.model.flops`) plus the forward the
backward recomputes for every layer that has no kept graph (:func:`~megatrain_ray.model.flops.recompute_flops`;
more within recompute spans, see :func:`~megatrain_ray.engine.compute.activations.recomputed_layers`),
at :data:`ACHIEVED` of the GPU's nominal bf16 dense rate (by its name, :data:`NOMINAL_TFLOPS`; or
the rate ``megatrain-ray plan --gpu-tflops`` gives, e.g. one measured by ``megatrain-ray bench``).
On the CPU, :data:`CPU_TFLOPS_PER_CORE` per usable core, plus :data:`CPU_UNIT_S` for each unit of
the store (decoder layers, embedding, head) a step passes through: the fixed cost of its fetch,
tickets and small GEMMs, which is most of a small model's step. It is an estimate to plan by (measured
steps differ from it by tens of percent, see :data:`ACHIEVED`), and a bound for the timeouts:

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

ACHIEVED = 0.85
"""Share of the nominal rate a step's FLOPs (model + recompute, PaLM's convention) run at. Measured
on an H200 (989 nominal): the whole Qwen2.5-7B shape on one 524,288-token sequence ran 532 s per step
(first step, compile included; 468 PFLOP: 0.89), the 7B at 64 x 1,024 tokens 5.43 s (3.2 PFLOP:
0.60; short sequences leave the GPU waiting on the host more); LoRA over the Llama-3.1-70B shape
(nf4 base, 64 x 1,024 tokens) 44.1 s for 25.3 PFLOP (0.58); LoRA on the whole Qwen3-30B-A3B shape
(16 x 4 x 4,096 tokens) 19.7 s for 7.7 PFLOP (0.39: its grouped expert GEMMs run well below a dense
GEMM's rate). The expected step time is therefore optimistic for mixtures of experts and LoRA runs."""
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
HOST_ADAMW_PARAMS_PER_THREAD_S = 3.9e9 / 16
"""Parameters one CPU thread updates per second with exact AdamW (the native kernel: 3.9 G params/s
measured on the H200 box's 16 threads)."""
LINK_BYTES_S = 55e9
"""Host-device bytes per second, each way (pinned copies on the H200 box), which a device update's
state crosses."""
LINK_BOTH_BYTES_S = 100e9
"""Host-device bytes per second both ways at once (the H200 box): a device update's copies in and out
run side by side."""


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
    """The rate assumed: ACHIEVED of the nominal (or given) rate, TFLOP/s."""
    rate_note: str
    """Where the rate comes from, for the plan's line."""
    fixed_s: float = 0.0
    """Seconds beyond the FLOPs: the units' fixed costs (on the CPU, :data:`CPU_UNIT_S` each)."""
    units: int = 0
    """Units a step passes through (what ``fixed_s`` counts)."""

    @property
    def step_s(self) -> float:
        return (self.palm + self.recompute) / (self.tflops * 1e12) + self.fixed_s

    def line(self) -> str:
        """The plan's line: ``expected step time: ~9 min (...)``."""
        return (f"expected step time: ~{duration(self.step_s)} ({_flop(self.palm + self.recompute)} per GPU: "
                f"{_flop(self.palm)} of the model counting attention (PaLM; 6NT: {_flop(self.six_nt)}) + "
                f"{_flop(self.recompute)} recomputed in the backward, at {_flop(self.tflops * 1e12)}/s: {self.rate_note}"
                + (f"; + {duration(self.fixed_s)} of fixed costs, {self.units} units x "
                   f"{duration(self.fixed_s / self.units)}" if self.fixed_s else "") + ")")


def expected_pace(cfg: TrainConfig, device: str, recomputed: int, reforwarded: int = 0, tflops: float | None = None,
                  gpu_name: str | None = None) -> Pace:
    """The pace of ``cfg`` on ``device`` with ``recomputed`` decoder layers' forwards run again in
    the backward and ``reforwarded`` more within recompute spans (see
    :func:`~megatrain_ray.engine.compute.activations.recomputed_layers`); ``tflops``: the device's rate
    (default: nominal, by ``gpu_name`` on cuda)."""
    t = cfg.train
    tokens = t.seq_len * t.micro_batch_size * t.num_micro_batches / cfg.parallel.workers
    if tflops is not None:
        rate, note = tflops * ACHIEVED, f"{ACHIEVED:.0%} of the {tflops:,.0f} given"
    elif device == "cpu":
        cores = usable_cpus()
        rate, note = CPU_TFLOPS_PER_CORE * cores, f"a nominal {CPU_TFLOPS_PER_CORE * 1e3:.0f} GFLOP/s per CPU core x {cores}"
    else:
        nominal = next((r for part, r in NOMINAL_TFLOPS if gpu_name and part in gpu_name), None)
        if nominal is None:
            nominal, what = DEFAULT_GPU_TFLOPS, (f"an H100/H200's (the {gpu_name} is not in the table"
                                                 if gpu_name else "an H100/H200's (no GPU visible here") + \
                "; --gpu-tflops sets it)"
        else:
            what = f"the {gpu_name}'s"
        rate, note = nominal * ACHIEVED, f"{ACHIEVED:.0%} of {what} nominal {nominal:,.0f} bf16"
    m = cfg.model
    if cfg.lora.enabled:  # no weight-gradient GEMMs for the frozen base (megatrain_ray.model.flops)
        six, palm = lora_flops(m, cfg.lora, t.seq_len, int(tokens))
    else:
        six, palm = flops_6nt(m, tokens), palm_model_flops(m, t.seq_len, tokens)
    units = m.num_hidden_layers + 2  # the decoder layers, the embedding and the head
    fixed = CPU_UNIT_S * units if device == "cpu" and tflops is None else 0.0
    return Pace(palm, six, recompute_flops(m, t.seq_len, tokens, recomputed, reforwarded), rate, note, fixed, units)


@dataclass(frozen=True)
class UpdatePace:
    """Where a step's AdamW updates run (optim.placement) and what each path should take."""

    host_params: int
    """Parameters the gradient sink updates on the host's CPU threads."""
    host_threads: int
    """The sink's AdamW threads."""
    device_params: int
    """Parameters of the streamed units updated on the compute worker's device (optim.placement device)."""
    device_bytes_in: int
    """Bytes per such parameter copied in: fp32 master weights and two moments."""
    device_bytes_out: int
    """Bytes per such parameter written back: the same, and the stream copy where the store keeps one."""

    @property
    def host_s(self) -> float:
        """The host's update time per step (beside the device's step, as the updates overlap the next one)."""
        return self.host_params / (HOST_ADAMW_PARAMS_PER_THREAD_S * max(1, self.host_threads))

    @property
    def device_s(self) -> float:
        """The device updates' time per step: their state across the link, in and out side by side (the
        update itself, memory-bound on the device, is a small fraction of it), added to the device's step."""
        n, i, o = self.device_params, self.device_bytes_in, self.device_bytes_out
        return max(n * i / LINK_BYTES_S, n * o / LINK_BYTES_S, n * (i + o) / LINK_BOTH_BYTES_S)

    def step_s(self, pace: Pace) -> float:
        """The expected step time with the updates: the device's step and its updates, or the host's
        updates where they take longer."""
        return max(pace.step_s + self.device_s, self.host_s)

    def line(self, pace: Pace) -> str:
        """The plan's line on the updates."""
        host = (f"host {_count(self.host_params)} parameters on {self.host_threads} CPU thread(s), "
                f"~{duration(self.host_s)} at {HOST_ADAMW_PARAMS_PER_THREAD_S / 1e6:.0f}M parameters/s per thread, "
                "beside the next step")
        device = (f"device {_count(self.device_params)} parameters, ~{duration(self.device_s)} added to the step "
                  f"(their state over the link: {self.device_bytes_in} bytes per parameter in and "
                  f"{self.device_bytes_out} out at "
                  f"{LINK_BYTES_S / 1e9:.0f} GB/s each way, {LINK_BOTH_BYTES_S / 1e9:.0f} both)")
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
