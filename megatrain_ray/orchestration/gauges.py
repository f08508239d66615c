"""The names and units of the pipeline's Ray gauges, in one place for everything that shows them.

:mod:`megatrain_ray.orchestration.metrics` sets the gauges (exported as ``ray_megatrain_<name>``),
:mod:`megatrain_ray.orchestration.grafana` builds the Grafana dashboard's panels from these units,
and ``megatrain-ray plot`` labels its axes with them. Nothing heavy is imported here (the plot
command stays quick).
"""

STAGES = ("h2d", "compute", "d2h", "wait", "device_update", "adamw")
"""The pipeline stages, as metrics.jsonl, timeline.json and the gauges' ``stage`` tag name them."""

STAGE_ROLE = {"h2d": "compute", "compute": "compute", "d2h": "compute", "wait": "compute", "device_update": "compute",
              "adamw": "grad-sink"}
"""The role whose busy time each stage is: the compute worker's four lanes and its AdamW on the device
(units resident there, streamed units under optim.placement device, a LoRA run's adapters; within its
compute and copy lanes), the sink's AdamW on the host."""

UNITS = {
    "tokens_per_s": "tokens/s", "tflops_6nt": "TFLOP/s", "tflops_palm": "TFLOP/s", "step_time_s": "s",
    "loss": "nats/token", "val_loss": "nats/token", "learning_rate": "", "grad_norm": "", "step": "steps",
    "checkpoint_step": "steps", "host_store_bytes": "bytes", "host_memory_used_bytes": "bytes",
    "device_peak_bytes": "bytes", "stage_busy_s": "s", "stage_busy_fraction": "share of the step",
    "link_gbps": "GB/s", "queue_depth": "items", "worker_busy_fraction": "share of the step",
    "worker_link_gbps": "GB/s", "role_step": "steps", "role_unit": "",
    "aux_loss": "nats/token", "expert_tokens": "tokens", "expert_imbalance": "",
}
"""Every gauge (name without the ``ray_megatrain_`` prefix) and its unit ("" for a plain number)."""

MOE_GAUGES = ("aux_loss", "expert_tokens", "expert_imbalance")
"""The gauges only a mixture of experts sets (a dense run exports none of them)."""
