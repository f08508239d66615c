"""Per-step metrics of a run: one JSON line each in runs/<id>/metrics.jsonl, and Ray metrics.

The driver records every step through :class:`RunMetrics`, which sets gauges made with
``ray.util.metrics``; Ray's metrics agent exports them on each node's Prometheus endpoint (and so
to the dashboard's Grafana panels) as ``ray_megatrain_<name>``, tagged with the run id (the two
FLOPs conventions are defined in :mod:`megatrain_ray.model.flops`):

==========================  ========================================================================
tokens_per_s                tokens trained per second over the last step (those the loss counts:
                            in SFT the response tokens only)
tflops_6nt                  model TFLOP/s counted as 6 x every parameter x tokens (6NT)
tflops_palm                 model TFLOP/s counted as PaLM does: 6 x matmul parameters + attention, per token
step_time_s                 wall time of the last step on the compute worker
stage_busy_s{stage,role}    busy seconds of the last step per stage: h2d, compute, d2h, wait (the
                            compute worker's lanes, role compute), device_update (its AdamW on the
                            device, within those lanes), adamw (the host's, role grad-sink)
stage_busy_fraction{..}     the same, divided by the step time
link_gbps{direction}        GB/s of the host-device copies while busy (h2d, d2h)
loss, learning_rate, grad_norm
val_loss                    validation loss at the last train.eval_every step
queue_depth{queue}          items waiting, when the step is logged: gradients for the sink (grad),
                            fetch tickets ready for a compute worker (fetch, fetch-1, ...)
host_store_bytes            bytes of the host store in shared memory
host_memory_used_bytes      used RAM of the node
device_peak_bytes           peak device memory of the compute worker during the step
step, checkpoint_step       last finished step, last saved checkpoint
worker_busy_fraction, worker_link_gbps   the same per compute worker (tag worker: 0, 1, ...)
aux_loss                    a mixture of experts: the load-balancing part of the last step's loss
expert_tokens{layer,expert} tokens each expert of each sparse layer received in the last step
expert_imbalance{layer}     max / mean of those per sparse layer (1: balanced)
==========================  ========================================================================

:data:`megatrain_ray.orchestration.gauges.UNITS` gives each gauge's unit, the one ``megatrain-ray
plot`` labels its axes with and the Grafana dashboard (``megatrain_ray/dashboards/megatrain.json``) shows.
The experiment trackers of ``train.loggers`` (:mod:`megatrain_ray.orchestration.trackers`) get
the same values under the same names (:attr:`RunMetrics.scalars`).

Ray's metrics agent drops the metrics of a process that has not reported for ``RAY_WORKER_TIMEOUT_S``
(120 s): a run's gauges leave the endpoint about two minutes after the run ended (its roles' processes
are gone, and the driver sets none), a scraping Prometheus keeps their history.
"""

from __future__ import annotations

import psutil

from ..config import ModelConfig
from ..model import flops
from . import expert_load
from .gauges import STAGE_ROLE, STAGES, UNITS  # noqa: F401  (UNITS: the units of the gauges set here)


class RunMetrics:
    """The gauges of one run (create in the driver after ray.init)."""

    def __init__(self, run_id: str, model: ModelConfig, seq_len: int, store_bytes: int, trackers=None, lora=None):
        """lora: a LoRA run's section (its FLOPs are counted as it runs them, see megatrain_ray.model.flops)."""
        from ray.util.metrics import Gauge

        self.tags = {"run_id": run_id}
        self.trackers = trackers
        """A :class:`~megatrain_ray.orchestration.trackers.Trackers` given every step's scalars, or None."""
        self.checkpoint_step: int | None = None
        self.scalars: dict[str, float] = {}
        """What the last step set: {gauge name, then its tags' values after a slash (``stage_busy_s/h2d``,
        ``worker_busy_fraction/0/compute``): value}, the names the trackers log."""
        self.model, self.seq_len, self.lora = model, seq_len, lora
        self.store_bytes = store_bytes

        def gauge(name: str, description: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"megatrain_{name}", description=description, tag_keys=("run_id", *extra))

        self.g = {
            "tokens_per_s": gauge("tokens_per_s", "Tokens trained per second over the last step."),
            "tflops_6nt": gauge("tflops_6nt", "Model TFLOP/s of the last step, 6 x all parameters x tokens."),
            "tflops_palm": gauge("tflops_palm", "Model TFLOP/s of the last step as PaLM counts them "
                                 "(6 x matmul parameters + 12 L S heads head_dim, per token)."),
            "step_time_s": gauge("step_time_s", "Wall time of the last step on the compute worker, seconds."),
            "loss": gauge("loss", "Training loss of the last step."),
            "val_loss": gauge("val_loss", "Validation loss at the last train.eval_every step."),
            "learning_rate": gauge("learning_rate", "Learning rate of the last step."),
            "grad_norm": gauge("grad_norm", "Global gradient norm of the last step, before clipping."),
            "step": gauge("step", "Number of steps finished."),
            "checkpoint_step": gauge("checkpoint_step", "Step of the newest checkpoint saved."),
            "host_store_bytes": gauge("host_store_bytes", "Bytes of the host parameter store in shared memory."),
            "host_memory_used_bytes": gauge("host_memory_used_bytes", "Used RAM of the node, bytes."),
            "device_peak_bytes": gauge("device_peak_bytes", "Peak device memory of the compute worker, bytes."),
        }
        self.stage_busy = gauge("stage_busy_s", "Busy seconds of the last step per pipeline stage.", ("stage", "role"))
        self.stage_fraction = gauge("stage_busy_fraction", "Busy share of the last step per stage.",
                                    ("stage", "role"))
        self.link = gauge("link_gbps", "Host-device copy bandwidth while busy, GB/s.", ("direction",))
        self.queue = gauge("queue_depth", "Items waiting in a pipeline queue.", ("queue",))
        self.worker_fraction = gauge("worker_busy_fraction", "Busy share of the last step per compute worker "
                                     "(GPU) and stage.", ("worker", "stage"))
        self.aux = gauge("aux_loss", "A mixture of experts: the load-balancing part of the last step's loss.")
        self.expert_tokens = gauge("expert_tokens", "Tokens each expert of each sparse layer received in the last "
                                   "step.", ("layer", "expert"))
        self.imbalance = gauge("expert_imbalance", "Max / mean tokens per expert of each sparse layer in the last "
                               "step.", ("layer",))
        self.worker_link = gauge("worker_link_gbps", "Host-device copy bandwidth of each compute worker (GPU) "
                                 "while busy, GB/s.", ("worker", "direction"))

    def tflops(self, tokens: int, step_s: float) -> dict[str, float]:
        """The metrics.jsonl entries of a step's model TFLOP/s, one per convention (tflops_6nt, tflops_palm)."""
        return flops.tflops(self.model, self.seq_len, tokens, step_s, self.lora)

    def step(self, row: dict, queue_depths: dict[str, int | None] | None = None) -> None:
        """Record one metrics.jsonl row (see :meth:`megatrain_ray.orchestration.driver.Driver._log_step`)
        and the depths of the pipeline's queues ({queue tag: items}; None where one did not answer)."""
        step_s = max(row.get("step_s", 0.0), 1e-9)
        values = {
            "tokens_per_s": row["tokens"] / step_s,
            **self.tflops(row["tokens"], step_s),
            "step_time_s": row["step_s"],
            "loss": row["loss"],
            "learning_rate": row["lr"],
            "grad_norm": row["grad_norm"],
            "step": row["step"],
            "host_store_bytes": self.store_bytes,
            "host_memory_used_bytes": psutil.virtual_memory().used,
            "device_peak_bytes": row.get("device_peak_bytes") or 0,
        }
        if "val_loss" in row:
            values["val_loss"] = row["val_loss"]
        self.scalars = {}
        for name, value in values.items():
            self._set(self.g[name], name, value)
        for stage in STAGES:
            busy = row.get("update_busy_s" if stage == "adamw" else f"{stage}_busy_s", 0.0)
            tags = {"stage": stage, "role": STAGE_ROLE[stage]}
            self._set(self.stage_busy, "stage_busy_s", busy, tags)
            self._set(self.stage_fraction, "stage_busy_fraction", busy / step_s, tags)
        for direction in ("h2d", "d2h"):
            busy = row.get(f"{direction}_busy_s", 0.0)
            if busy > 0:
                self._set(self.link, "link_gbps", row.get(f"{direction}_bytes", 0) / busy / 1e9, {"direction": direction})
        for name, depth in (queue_depths or {}).items():
            if depth is not None:
                self._set(self.queue, "queue_depth", depth, {"queue": name})
        if "expert_tokens" in row:
            self._experts(row)
        for w, worker in enumerate(row.get("workers") or (row,)):  # each GPU's own lanes (rank order)
            for lane in ("compute", "h2d", "d2h", "wait"):
                self._set(self.worker_fraction, "worker_busy_fraction", worker.get(f"{lane}_busy_s", 0.0) / step_s,
                          {"worker": str(w), "stage": lane})
            for direction in ("h2d", "d2h"):
                busy = worker.get(f"{direction}_busy_s", 0.0)
                if busy > 0:
                    self._set(self.worker_link, "worker_link_gbps", worker.get(f"{direction}_bytes", 0) / busy / 1e9,
                              {"worker": str(w), "direction": direction})
        if self.checkpoint_step is not None:
            self.scalars["checkpoint_step"] = float(self.checkpoint_step)
        if self.trackers is not None:
            self.trackers.log(self.scalars, row["step"])

    def _set(self, gauge, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        """Set ``gauge`` (tagged with the run id and ``tags``) and record it in :attr:`scalars`, under the
        gauge's name, then the values of ``tags`` (in the gauge's tag order, the stage's role left out)."""
        gauge.set(float(value), tags={**self.tags, **(tags or {})})
        parts = [v for k, v in (tags or {}).items() if k != "role"]
        self.scalars["/".join([name, *parts])] = float(value)

    def _experts(self, row: dict) -> None:
        """A mixture of experts' gauges: aux_loss, and per sparse layer (its decoder layer index) the
        tokens of each expert and their imbalance."""
        self._set(self.aux, "aux_loss", row["aux_loss"])
        for layer, counts in zip(self.model.sparse_layers, row["expert_tokens"]):
            for e, n in enumerate(counts):
                self._set(self.expert_tokens, "expert_tokens", n, {"layer": str(layer), "expert": str(e)})
            self._set(self.imbalance, "expert_imbalance", expert_load.imbalance(counts), {"layer": str(layer)})

    def checkpoint(self, step: int) -> None:
        """The newest checkpoint's step: on its gauge now, to the trackers with the next step's scalars
        (a tracker may take steps in increasing order only, and this notice can come before the rows of
        the steps it holds)."""
        self.g["checkpoint_step"].set(step, tags=self.tags)
        self.checkpoint_step = step
