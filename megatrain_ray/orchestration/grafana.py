"""The Grafana dashboard of the pipeline's gauges, and where Ray's own Grafana setup picks it up.

:func:`dashboard` builds it from :data:`PANELS` and the units of
:data:`megatrain_ray.orchestration.gauges.UNITS`; the package ships the result as
``megatrain_ray/dashboards/megatrain.json`` (a test keeps the two equal; after changing a panel,
rewrite it with ``python -m megatrain_ray.orchestration.grafana``). Every query reads the
``ray_megatrain_*`` gauges of :mod:`megatrain_ray.orchestration.metrics` through a Prometheus data
source chosen in the dashboard (``$datasource``), for the runs chosen in ``$run_id``.

Ray writes a Grafana configuration for its own dashboards into
``<session dir>/metrics/grafana`` when its dashboard starts (``grafana.ini``, a Prometheus data
source, and a provisioning folder ``dashboards/``); :func:`install` copies this file into that
folder, so a Grafana started with Ray's ``grafana.ini`` shows it next to Ray's.
"""

from __future__ import annotations

import json
import os
import shutil

from .gauges import UNITS

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dashboards", "megatrain.json")
"""The dashboard file in the installed package."""

UID = "megatrain-ray"

GRAFANA_UNITS = {"tokens/s": "suffix: tokens/s", "TFLOP/s": "suffix: TFLOP/s", "s": "s",
                 "nats/token": "suffix: nats/token", "": "none", "steps": "none", "bytes": "bytes",
                 "share of the step": "percentunit", "GB/s": "GBs", "items": "none", "tokens": "none"}
"""Unit of :data:`UNITS` -> Grafana's unit id (``percentunit`` shows a share 0..1 as percent;
``GBs`` is gigabytes per second, 1e9 bytes, as link_gbps counts them)."""

PANELS = [
    # (title, [(metric, legend), ...], description)
    ("Throughput", [("tokens_per_s", "tokens/s")], "Tokens trained per second over the last step."),
    ("Model TFLOP/s, both conventions", [("tflops_6nt", "6·N·T"), ("tflops_palm", "PaLM (matmuls + attention)")],
     "6·N·T counts 6 x every parameter per token; PaLM's counts 6 x the matmul parameters plus attention "
     "(megatrain_ray.model.flops)."),
    ("Step time", [("step_time_s", "step")], "Wall time of the last step on the compute worker."),
    ("Stage busy share per role", [("stage_busy_fraction", "{{role}} {{stage}}")],
     "Busy share of the last step per stage: the compute worker's copy-in (h2d), compute, copy-out (d2h) "
     "and wait lanes, the grad-sink's AdamW. Stages overlap, so the shares do not add up to one."),
    ("Stage busy seconds per role", [("stage_busy_s", "{{role}} {{stage}}")],
     "Busy seconds of the last step per stage."),
    ("Busy share per compute worker", [("worker_busy_fraction", "worker {{worker}} {{stage}}")],
     "Each compute worker's (GPU's) lanes (parallel.compute_workers per node)."),
    ("Queue depths", [("queue_depth", "{{queue}}")],
     "Items waiting when the step is logged: gradients for the sink (grad), unit tickets ready for a compute "
     "worker (fetch; 0 means the worker waits for weights)."),
    ("Link GB/s per direction", [("link_gbps", "{{direction}}"), ("worker_link_gbps", "worker {{worker}} {{direction}}")],
     "Host-device copy bandwidth while busy: h2d (weights in), d2h (gradients out)."),
    ("Host memory", [("host_store_bytes", "parameter store (shared memory)"),
                     ("host_memory_used_bytes", "node RAM used")], "Bytes of host RAM."),
    ("GPU memory", [("device_peak_bytes", "peak on the compute worker")],
     "Peak device memory of the compute worker during the last step."),
    ("Loss", [("loss", "train"), ("val_loss", "validation"), ("aux_loss", "load-balancing part of train")],
     "Cross-entropy, nats per token; a mixture of experts' training loss includes router_aux_loss_coef x its "
     "load-balancing loss (shown apart)."),
    ("Experts: imbalance per sparse layer", [("expert_imbalance", "layer {{layer}}")],
     "A mixture of experts: max / mean tokens per expert of each sparse layer in the last step (1: balanced)."),
    ("Experts: tokens per expert", [("expert_tokens", "layer {{layer}} expert {{expert}}")],
     "A mixture of experts: the tokens each expert of each sparse layer received in the last step."),
    ("Learning rate", [("learning_rate", "lr")], "Learning rate of the last step."),
    ("Gradient norm", [("grad_norm", "grad norm")], "Global gradient norm of the last step, before clipping."),
    ("Progress", [("step", "steps done"), ("checkpoint_step", "last checkpoint")],
     "Steps finished, and the step of the newest checkpoint."),
    ("What each role is doing: step", [("role_step", "{{role}}")],
     "The step the prefetcher issues weights for and the sink applies updates of (set by the roles)."),
    ("What each role is doing: unit", [("role_unit", "{{role}}")],
     "The unit (0 the embedding, then the decoder layers, then the head) the prefetcher issues and the sink "
     "updates: the prefetcher runs ahead by the device's weight slots."),
]
"""The panels, in page order (two per row): title, (gauge, legend) per series, description."""


def metric_names() -> set[str]:
    """Every gauge (without the ``ray_megatrain_`` prefix) that a panel reads."""
    return {metric for _, series, _ in PANELS for metric, _ in series}


def _panel(k: int, title: str, series: list[tuple[str, str]], description: str) -> dict:
    units = {UNITS[m] for m, _ in series}
    if len(units) != 1:
        raise ValueError(f"panel {title!r} mixes units {sorted(units)}")
    return {
        "id": k + 1, "type": "timeseries", "title": title, "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (k % 2), "y": 8 * (k // 2)},
        "fieldConfig": {"defaults": {"unit": GRAFANA_UNITS[units.pop()]}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [{"refId": chr(ord("A") + i), "datasource": {"type": "prometheus", "uid": "${datasource}"},
                     "expr": f'ray_megatrain_{metric}{{run_id=~"$run_id"}}',
                     "legendFormat": f"{{{{run_id}}}} {legend}"} for i, (metric, legend) in enumerate(series)],
    }


def dashboard() -> dict:
    """The Grafana dashboard (JSON model) of every panel of :data:`PANELS`."""
    return {
        "uid": UID, "title": "megatrain_ray pipeline", "tags": ["megatrain", "ray"], "editable": True,
        "schemaVersion": 39, "time": {"from": "now-30m", "to": "now"}, "refresh": "5s",
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
            {"name": "run_id", "label": "run", "type": "query", "multi": True, "includeAll": True,
             "datasource": {"type": "prometheus", "uid": "${datasource}"}, "refresh": 2,
             "query": {"query": "label_values(ray_megatrain_step, run_id)", "refId": "run_id"},
             "definition": "label_values(ray_megatrain_step, run_id)",
             "current": {"text": "All", "value": "$__all"}},
        ]},
        "panels": [_panel(k, *panel) for k, panel in enumerate(PANELS)],
    }


def render() -> str:
    """The text of the shipped file."""
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def install(session_dir: str | None) -> str | None:
    """Copy the shipped dashboard into Ray's Grafana provisioning folder of ``session_dir`` (the Ray
    session's directory on this machine), where Ray's dashboard created one; the path, or None."""
    folder = os.path.join(session_dir or "", "metrics", "grafana", "dashboards")
    if not session_dir or not os.path.isdir(folder):
        return None
    path = os.path.join(folder, "megatrain_ray_pipeline.json")
    shutil.copyfile(SHIPPED, path)
    return path


if __name__ == "__main__":
    with open(SHIPPED, "w") as f:
        f.write(render())
    print(SHIPPED)
