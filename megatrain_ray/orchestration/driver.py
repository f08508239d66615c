"""The driver's loop over one run's steps: submit, wait, log; on an interrupt, drain and save.

Steps go to every compute worker (each takes its share of the step's micro-batches); two steps
are kept queued at each, so no worker waits on the driver. A step's outputs (the workers' losses
summed, timings of the first worker) and the first node's sink stats (grad norm, lr) are joined
into one metrics row when both are in. What the run saves at its end and on an interrupt, and
which role writes it (the store, or a LoRA run's first compute worker), is one object chosen when
the driver is built (:mod:`megatrain_ray.orchestration.saves`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from ..data.datasets import run_tokenizer
from ..errors import ActorDied, Interrupted, MegatrainError, PipelineError
from ..engine.compute.resident import checkpoint_due, sync_due
from ..io import checkpoint
from ..io.files import replacing
from ..progress import Eta
from . import expert_load
from .calls import get as _get
from .labels import step_task
from .metrics import RunMetrics
from .step_notes import StepNotes
from .resolve import ResolvedRun
from .roles import Roles
from .saves import AdapterSaves, StoreSaves


@dataclass
class RunResult:
    """What a finished run reports."""

    run_id: str
    run_dir: str
    final_dir: str
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    val_losses: dict[int, float] = field(default_factory=dict)
    """step -> validation loss of the weights that step started from (train.eval_every)."""
    fetches: list[dict[str, int]] = field(default_factory=list)
    tokens_per_s: float = 0.0
    timeline: list[tuple] = field(default_factory=list)
    """(lane, label, start, end, bytes) intervals of the last two steps: h2d, compute, d2h, wait
    (the compute thread blocked on weights), device_update (AdamW of streamed units on the device) and adamw."""
    last_intervals: list[tuple] = field(default_factory=list, repr=False)
    start_step: int = 0
    """First step this run trained (the checkpoint's step when resumed)."""
    checkpoints: list[str] = field(default_factory=list)
    """Checkpoint directories saved by this run, oldest first."""
    restarts: int = 0
    """How many times the pipeline was restarted after an actor died (cluster.max_restarts)."""
    repeated_steps: int = 0
    """Steps finished before a restart and trained again after it (from the checkpoint restarted from);
    the per-step lists and metrics.jsonl hold each step once, as its last attempt trained it."""


@contextlib.contextmanager
def _signals_deferred():
    """Hold SIGINT/SIGTERM until the block ends, so a submitted step is always recorded as such and a
    step's row and line are written together. The kernel hands a signal to any thread that does not
    block it (Ray's threads too) and Python runs its handler in the main thread at the next bytecode,
    so the handlers themselves are swapped for one that notes the signal; the block's end restores
    them and passes each noted signal to its own."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    held = {s: signal.signal(s, lambda signum, frame: noted.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in held.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        for s in dict.fromkeys(noted):
            if callable(held[s]):
                held[s](s, None)
            elif held[s] == signal.SIG_DFL:
                signal.raise_signal(s)


class Driver:
    """See the module docstring."""

    WINDOW = 2

    def __init__(self, run: ResolvedRun, roles: Roles, loops: dict, checkpoints: checkpoint.CheckpointSettings | None,
                 result: RunResult, metrics_file, gauges: RunMetrics, log, eval_ref=None, health=None):
        """run: the resolved run whose roles ``roles`` are (its config and call timeout)."""
        self.cfg, self.roles, self.loops, self.checkpoints = run.config, roles, loops, checkpoints
        self.head = roles.head
        self.eval_ref = eval_ref
        self.health = health
        """A :class:`~megatrain_ray.orchestration.health.Health` checked while a step is awaited, or None."""
        """The validation batch (an object ref) that rides along every train.eval_every-th step, or None."""
        self.result, self.metrics_file, self.gauges, self.log = result, metrics_file, gauges, log
        self.steps = run.config.train.steps
        self.timeout = run.call_timeout_s
        self.submitted: dict[int, Any] = {}
        """step -> refs of its run_step calls (one per compute worker), until their results are in."""
        self.outputs: dict[int, dict] = {}
        self.stats: dict[int, dict] = {}
        self.tokens = 0
        self.clock = time.perf_counter()
        self.step_s: float | None = None
        """Wall time of the last step logged, and of the last checkpoint save (for the interrupt's estimate)."""
        self.save_s: float | None = None
        self.eta = Eta()
        """The time left, from the pace of the steps logged after the first (compile and warm-up)."""
        self.notes = StepNotes(log, self.steps, self.head.fetch_qs[0] if self.head.fetch_qs else None)
        """The lines while a long step runs."""
        self.saves = (AdapterSaves if run.config.lora.enabled else StoreSaves)(run, roles, checkpoints, log)
        """What the run saves and who writes it: the store, or a LoRA run's first compute worker."""

    def run(self, batch_ref, start: int) -> RunResult:
        self.start = start
        try:
            for step in range(start, min(start + self.WINDOW, self.steps)):
                self._submit(step, batch_ref)
            for step in range(start, self.steps):
                self._collect(step)
                if step + self.WINDOW < self.steps:
                    self._submit(step + self.WINDOW, batch_ref)
                self._handle(self.head.stats_q.drain())
            for ref, role in list(self.loops.items()):  # the sink's ends with the final checkpoint
                _get(ref, role, self.timeout)
            self._handle(self.head.stats_q.drain())
        except KeyboardInterrupt as e:  # Ctrl-C's has no text; a SIGTERM's says "signal 15"
            raise Interrupted(*self._checkpoint_on_interrupt(start, by_sigterm=bool(str(e)))) from None
        except ActorDied:
            self._salvage()
            raise
        r = self.result
        r.tokens_per_s = self.tokens / (time.perf_counter() - self.clock)
        if self.cfg.train.save_final:
            try:
                self._save_final()
            except KeyboardInterrupt:  # every step is trained and in the last checkpoint: say where it is
                raise Interrupted(r.checkpoints[-1] if r.checkpoints else None,
                                  "" if r.checkpoints else "it came as the final weights were written") from None
        with open(os.path.join(r.run_dir, "timeline.json"), "w") as f:
            json.dump(r.timeline, f)
        loss = f"final loss {r.losses[-1]:.4f}, " if r.losses else ""
        saved = self.saves.said(r) if self.cfg.train.save_final else "final weights not saved"
        again = (f" (after {r.restarts} restart{'s' if r.restarts > 1 else ''}, which trained {r.repeated_steps} "
                 f"step{'' if r.repeated_steps == 1 else 's'} twice)") if r.restarts else ""
        self.log(f"done: {self.steps - r.start_step} steps{again}, {loss}{r.tokens_per_s:,.0f} tokens/s; {saved}")
        return r

    def _save_final(self) -> None:
        """The final weights (and a LoRA run's adapters), replacing those of an earlier session of a
        resumed run, with the tokenizer the data was read with (for generate())."""
        with replacing(*self.saves.final_dirs(self.result)):
            tokenizer = run_tokenizer(dataclasses.asdict(self.cfg.data), self.cfg.train.init_from)
            self.saves.final(self.result, tokenizer)

    def _submit(self, step: int, batch_ref) -> None:
        with _signals_deferred():
            due = self.cfg.train.eval_due(step)
            batch = batch_ref(step)  # the whole step's batch: each worker takes its share
            name = step_task(step, self.steps)  # what the dashboard lists as the worker's running task
            resident = (sync_due(self.checkpoints, step, self.start, self.steps),  # the resident units' copy (engine.compute.resident)
                     checkpoint_due(self.checkpoints, step, self.start, self.steps))
            profile = self._profile_dir(step)  # each worker's profile goes into it
            self.submitted[step] = [c.run_step.options(name=name).remote(step, batch,
                                                                         self.eval_ref if due and rank == 0 else None,
                                                                         *resident, profile=profile)
                                    for rank, c in enumerate(self.roles.computes)]

    def _profile_dir(self, step: int) -> str | None:
        """Where step ``step`` (0-based)'s profiles go (train.profile_steps counts from 1); None: not profiled."""
        if step + 1 not in self.cfg.train.profile_steps:
            return None
        return os.path.join(self.result.run_dir, "profile", f"step-{step + 1}")

    def _collect(self, step: int) -> None:
        """Wait for run_step(step) of every worker, watching the prefetcher and sink loops and the
        health of the other roles for failures."""
        refs = self.submitted[step]
        outs: dict[Any, dict] = {}
        while len(outs) < len(refs):
            done, _ = ray.wait([*(r for r in refs if r not in outs), *self.loops], num_returns=1, timeout=1.0)
            if self.health is not None:
                self.health.check()  # the idle roles (store, loaders, queues): dead or hung?
            self.notes.waiting(step)
            for r in done:
                if r in self.loops:  # a loop ended early: fine if it finished its work, else its error is raised
                    _get(r, self.loops.pop(r), self.timeout)
                else:  # read at once: a worker that failed must not wait for the others, stuck in a collective
                    outs[r] = _get(r, "compute", self.timeout)
        out = _combine([outs[r] for r in refs])
        if not math.isfinite(out["loss"]):
            del self.submitted[step]
            self._diverged(step, out["loss"])
        with _signals_deferred():  # an interrupt finds the step either still submitted or recorded
            del self.submitted[step]
            self._record(step, out)

    def _record(self, step: int, out: dict) -> None:
        """Count a step's combined output: its loss in the result, its row once the sink's stats are in."""
        self.tokens += out["tokens"]
        self.result.losses.append(out["loss"])
        self.result.fetches.append(out["fetches"])
        self.outputs[step] = out
        self.notes.ended(out)
        if "checkpoint" in out:  # a LoRA run's, written by the compute worker (engine.compute.adapters)
            self._handle([out.pop("checkpoint")])

    def _salvage(self, within: float = 2.0) -> None:
        """After a role died: record what finished before it did, so the restart can resume from the
        newest checkpoint with every step before it reported (see
        :func:`~megatrain_ray.orchestration.pipeline._attempts`): the steps whose every worker had
        returned (in order, up to the first that had not) and the sink's stats and checkpoint notices
        still on the queue. Best effort, ``within`` seconds per call: a dead or hung worker or queue
        host leaves those steps unreported, and the restart then goes back to an earlier checkpoint."""
        for step in sorted(self.submitted):
            refs = self.submitted[step]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=within)
            try:
                out = _combine(ray.get(refs, timeout=within)) if len(ready) == len(refs) else None
            except Exception:  # noqa: BLE001 (a worker that died with this step: it stays unreported)
                out = None
            if out is None or not math.isfinite(out["loss"]):
                break
            del self.submitted[step]
            self._record(step, out)
        try:
            items = self.head.stats_q.drain(within=within)
        except Exception:  # noqa: BLE001 (the queue host died or hangs: its stats are lost with it)
            return
        self._handle(items)

    def _diverged(self, step: int, loss: float) -> None:
        """Let the sink reach its verdict on this step (and finish any save it is writing), then stop."""
        sink = [r for r, role in self.loops.items() if role == "grad-sink"]
        deadline = time.monotonic() + self.timeout
        while sink and step not in self.stats and time.monotonic() < deadline:
            done, _ = ray.wait(sink, timeout=0.5)
            if done:
                try:
                    _get(done[0], "grad-sink", self.timeout)
                except MegatrainError:
                    pass  # its non-finite gradient norm: the same divergence, said below
                break
            self._handle(self.head.stats_q.drain())
        self._handle(self.head.stats_q.drain())  # the notice of the save the sink finished first
        raise PipelineError(f"the loss of step {step + 1} is {loss}, so training diverged; lower optim.lr "
                            "(or raise optim.warmup_steps) or check the data.")

    def _handle(self, items: list[dict]) -> None:
        """Record sink messages: checkpoint notices, and step stats (logged once the step's output is in).
        An interrupt waits until they are recorded: a step taken off the queues always gets its row."""
        with _signals_deferred():
            self._handle_now(items)

    def _handle_now(self, items: list[dict]) -> None:
        """Every item recorded first, then the lines said: a line's failure (an interrupt raised by the
        log, a closed terminal) leaves no item of the batch unrecorded."""
        notices = []
        for st in items:
            if "checkpoint" in st:
                self.save_s = st["save_s"] + st.get("stall_s", 0.0)
                self.result.checkpoints.append(st["checkpoint"])
                self.gauges.checkpoint(st["step"])
                waited = ("the compute worker paused for it" if st.get("by") == "compute" else
                          f"the sink waited {st.get('stall_s', 0.0):.2f} s for it")
                notices.append(f"checkpoint: step {st['step']} saved to {st['checkpoint']} in {st['save_s']:.2f} s "
                               f"({waited})")
            else:
                self.stats[st["step"]] = st
        for line in notices:
            self.log(line)
        for step in sorted(s for s in self.stats if s in self.outputs):
            self._log_step(self.outputs.pop(step), self.stats.pop(step))

    def _log_step(self, out: dict, stats: dict) -> None:
        step, r = out["step"], self.result
        r.grad_norms.append(stats["grad_norm"])
        if "val_loss" in out:
            r.val_losses[step] = out["val_loss"]
        intervals = out["intervals"] + stats["intervals"]
        r.timeline, r.last_intervals = r.last_intervals + intervals, intervals
        now = time.perf_counter()
        elapsed = now - self.clock
        self.eta.step(now, out["step_s"])
        eta = self.eta.left_s(self.steps - step - 1)  # None after the first step: its pace is not the run's
        row = {"step": step + 1, "loss": out["loss"], "grad_norm": stats["grad_norm"], "lr": stats["lr"],
               "tokens": out["tokens"], "start": out["start"], "step_s": out["step_s"], "fetches": out["fetches"],
               "elapsed_s": elapsed, "eta_s": eta, "update_busy_s": stats["update_busy_s"],
               "tokens_per_s": out["tokens"] / max(out["step_s"], 1e-9),
               **self.gauges.tflops(out["tokens"], out["step_s"]),
               **{k: v for k, v in out.items() if k.endswith(("_busy_s", "_bytes"))},
               **({"val_loss": out["val_loss"]} if "val_loss" in out else {}),
               **{k: out[k] for k in ROUTING_KEYS if k in out},
               **expert_load.fields(self.cfg.model.sparse_layers, out.get("expert_tokens")),
               **({"workers": out["workers"]} if "workers" in out else {}),
               **({"profile": where} if (where := self._profile_dir(step)) else {})}
        self.step_s = out["step_s"]
        self.metrics_file.write(json.dumps(row) + "\n")
        self.metrics_file.flush()
        fetch = {f"fetch{f'-{w}' if w else ''}": q for w, q in enumerate(self.head.fetch_qs)}
        self.gauges.step(row, {name: _size(q) for name, q in {"grad": self.head.grad_q, **fetch}.items()})
        if step % self.cfg.train.log_every == 0 or step == self.steps - 1 or "val_loss" in out:
            val = f" | val loss {out['val_loss']:.4f} (after {step} updates)" if "val_loss" in out else ""
            self.log(f"step {step + 1:>5}/{self.steps} | loss {out['loss']:.4f} | grad norm {stats['grad_norm']:.3f} | "
                     f"lr {stats['lr']:.2e} | {self.tokens / elapsed:,.0f} tok/s | eta {_duration(eta)}{val}"
                     f"{expert_load.summary(row)}")
        if "profile" in row:
            self.log(f"profile: step {step + 1} recorded in {row['profile']} (each worker's trace.json.gz for Perfetto "
                     "or chrome://tracing, kernels.txt: where the device's time went)")

    def _expected(self, boundary: int) -> str:
        """How long the interrupt takes: the steps still to finish at the pace of the last, and a save as
        long as the last one; "" before any step was timed."""
        if self.step_s is None:
            return ""
        steps = max(1.0, max(1, boundary - self.result.start_step - len(self.result.losses)) * self.step_s)
        if self.save_s is None:
            return f" (the steps in about {_duration(steps)}, then the first save)"
        return f" (about {_duration(steps + self.save_s)})"

    def _checkpoint_on_interrupt(self, start: int, by_sigterm: bool = False) -> tuple[str | None, str]:
        """Finish the steps in flight, then save the boundary they reach; (path or None, why not).
        ``by_sigterm``: the interrupt was a SIGTERM (a scheduler, ``ray job stop``), whose repeat waits."""
        if self.checkpoints is None:
            return None, "checkpoints are off"
        if not self.cfg.train.checkpoint_on_interrupt:
            return None, "train.checkpoint_on_interrupt is false"
        if self.cfg.parallel.sharded_optimizer:
            return None, ("with parallel.optimizer_sharding=sharded each node holds its own units' AdamW states, "
                          "gathered only at train.checkpoint_every boundaries; resume from the last of those")
        done = self.result.start_step + len(self.result.losses)  # the losses of earlier attempts too
        boundary = max(self.submitted, default=done - 1) + 1
        if boundary <= start:
            return None, "no step had finished"
        _ignore_sigterm()  # a scheduler's repeated SIGTERM waits for the save (its SIGKILL follows anyway)
        again = "a repeated SIGTERM waits for it" if by_sigterm else "Ctrl-C again to stop without one"
        self.log(f"interrupted: finishing the steps up to {boundary} and saving a checkpoint{self._expected(boundary)} "
                 f"({again})")
        try:
            for step in sorted(self.submitted):
                out = _combine([_get(r, "compute", self.timeout) for r in self.submitted.pop(step)])
                if not math.isfinite(out["loss"]):
                    return None, f"the loss of step {step + 1} is {out['loss']}"
                self._record(step, out)
            # The store actor waits until the sink has applied every submitted step's update; the
            # compute worker's own units (memory.resident) it copies in first. A LoRA run's
            # checkpoint is the adapters', which the compute worker writes itself.
            save = self.saves.checkpoint(boundary)
            while True:
                ready, _ = ray.wait([save, *self.loops], num_returns=1, timeout=1.0)
                if save in ready:
                    break
                for r in ready:
                    _get(r, self.loops.pop(r), self.timeout)
                self._handle(self.head.stats_q.drain())
            path = self.saves.path(_get(save, "store", self.timeout))
            self._handle(self.head.stats_q.drain())
        except MegatrainError as e:
            return None, f"no checkpoint could be saved ({e})"
        self.result.checkpoints.append(path)
        self.log(f"checkpoint: step {boundary} saved to {path}")
        return path, ""


ROUTING_KEYS = ("aux_loss", "expert_tokens", "expert_refetches", "expert_grad_bytes")
"""A mixture of experts' step outputs in metrics.jsonl: the load-balancing loss's part of the loss
(coef x its mean over micro-batches), and per sparse layer and expert the tokens it received, its
fetches after the forward's routing (the backward's, a recompute span's) and the bytes of its
gradient sent to the host (:mod:`megatrain_ray.engine.experts`)."""


def _ignore_sigterm() -> None:
    """SIGTERM ignored from now on in this process (the run's end restores its handler)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _combine(outs: list[dict]) -> dict:
    """One step's result from every worker's: the loss (and its load-balancing part) and the tokens
    per expert summed (each worker's is its share), the slowest worker's time, the rest (timeline,
    fetch counts, validation loss) the first worker's."""
    if len(outs) == 1:
        return outs[0]
    per_worker = [{"fetches": o["fetches"], **{k: v for k, v in o.items() if k.endswith(("_busy_s", "_bytes"))},
                   "step_s": o["step_s"], "device_peak_bytes": o.get("device_peak_bytes")} for o in outs]
    routing = {}
    if "expert_tokens" in outs[0]:
        routing = {"aux_loss": sum(o["aux_loss"] for o in outs),
                   **{key: [[sum(c) for c in zip(*layers)] for layers in zip(*(o[key] for o in outs))]
                      for key in ROUTING_KEYS[1:] if key in outs[0]}}
    return {**outs[0], "loss": sum(o["loss"] for o in outs), "step_s": max(o["step_s"] for o in outs),
            **routing, "workers": per_worker}


def _size(q) -> int | None:
    """Items on ``q`` for the queue-depth gauge, or None if its host does not answer within a second."""
    try:
        return q.qsize(within=1.0)
    except Exception:
        return None


def _duration(seconds: float | None) -> str:
    """1h02m, 3m05s, 42s; ``...`` while unknown (None)."""
    if seconds is None:
        return "..."
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"
