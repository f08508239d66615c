"""``megatrain-ray plot RUN_DIR``: PNG plots of a run's metrics.jsonl (and timeline.json).

- ``loss.png``: training loss per step (and the validation loss, with train.eval_every), learning
  rate on a second axis;
- ``throughput.png``: tokens/s per step; the right axes read the same line in model TFLOP/s, one
  per FLOPs convention of :mod:`megatrain_ray.model.flops` (6·N·T and PaLM's; each is tokens/s
  times a fixed number of FLOPs per token, so they are one curve). metrics.jsonl files written
  before both were recorded carry one ``model_tflops``, which was PaLM's: read as such;
- ``stages.png``: busy share of each step per pipeline stage (copy in, compute, copy out, wait,
  adamw); stages overlap in time, so the shares do not add up to one;
- ``timeline.png``: the intervals of the run's last two steps, one row per stage (when the run
  finished and wrote timeline.json);
- ``experts.png`` (a mixture of experts): the load of each expert of each sparse layer over the run
  (tokens it received / the mean of its layer; 1 is a perfect balance), a heatmap of sparse layers
  (named by their decoder layer index) x experts, an expert that received no token in the whole run
  marked with a red x; each step's imbalance (max / mean tokens per expert, the worst and the median
  layer) and its idle experts (no token in that step, all sparse layers together).

Each plotted series is a Ray gauge of :mod:`megatrain_ray.orchestration.metrics` (:data:`GAUGES`),
so the plots and the Grafana dashboard (megatrain_ray/dashboards/megatrain.json) show the same numbers
in the same units (:data:`megatrain_ray.orchestration.gauges.UNITS`).

The copy stages are named for the run's device (runs/<id>/config.json): ``h2d`` / ``d2h`` on a
GPU, ``copy in`` / ``copy out`` (weights into a compute slot, gradients out of it) on the CPU.

Needs matplotlib (``pip install 'megatrain-ray[plot]'``).
"""

from __future__ import annotations

import json
import os

from .errors import ConfigError
from .orchestration import metrics_file
from .orchestration.expert_load import idle, imbalance
from .orchestration.gauges import STAGES, UNITS

GAUGES = {"loss": "loss", "val_loss": "val_loss", "lr": "learning_rate", "tokens_per_s": "tokens_per_s",
          "tflops_6nt": "tflops_6nt", "tflops_palm": "tflops_palm", "busy_fraction": "stage_busy_fraction"}
"""Each series the plots draw (its metrics.jsonl key; busy_fraction: a stage's busy seconds over the
step time, one line per stage as the gauge's ``stage`` tag) -> the gauge showing the same number."""
CPU_LABELS = {"h2d": "copy in", "d2h": "copy out"}
"""What the copy stages are on a CPU run: no host and device, the weights copied into a compute slot
and the gradients out of it."""


TFLOPS_CONVENTIONS = {"tflops_6nt": ("6·N·T", "right"), "tflops_palm": ("PaLM: matmuls + attention", 1.22)}
"""metrics.jsonl key -> (name of the FLOPs convention, where its axis sits: the right edge, or further
out in axes widths); the conventions are those of :mod:`megatrain_ray.model.flops`."""


def tflops(row: dict, name: str) -> float | None:
    """A metrics row's TFLOP/s in convention ``name`` (tflops_6nt, tflops_palm), or None. Rows from
    before both were recorded have ``model_tflops``, PaLM's convention."""
    if name in row:
        return row[name]
    return row.get("model_tflops") if name == "tflops_palm" else None


def read_metrics(run_dir: str) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl, one per step (the last row wins if a step repeats; a row's
    ``step`` is the updates done, 1 after the first, as the log and the checkpoints count them), after
    those of the runs it resumed: a run resumed in place holds its whole history itself; one resumed
    into a directory of its own (from a checkpoint older than its run's newest, or into another
    train.run_dir) names the checkpoint it began from in its config.json (``resumed_from``), and the
    steps before it are that run's rows (and so on back), so a plot shows the whole history."""
    rows = _read_rows(run_dir)
    seen = {os.path.realpath(run_dir)}
    while True:
        earlier = _resumed_run(run_dir)
        if earlier is None or os.path.realpath(earlier) in seen:
            return rows
        seen.add(os.path.realpath(earlier))
        try:
            before = [r for r in _read_rows(earlier) if r["step"] < rows[0]["step"]]
        except ConfigError:  # that run's metrics are gone: this run's alone
            return rows
        rows, run_dir = before + rows, earlier


def _resumed_run(run_dir: str) -> str | None:
    """The run directory of the checkpoint ``run_dir`` resumed from (``<run>/checkpoints/step-N``), or None."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            start = json.load(f).get("resumed_from")
    except (OSError, ValueError, AttributeError):
        return None
    if not start:
        return None
    run = os.path.dirname(os.path.dirname(os.path.normpath(start)))
    return run if os.path.isfile(os.path.join(run, "metrics.jsonl")) else None


def _read_rows(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"{run_dir!r} has no metrics.jsonl; pass a run directory (runs/<run id>).")
    rows = {int(row["step"]): row for row in metrics_file.read(path)[0]}  # a cut-short last line: left out
    if not rows:
        raise ConfigError(f"{path} has no rows yet: the run has not finished a step.")
    if 0 in rows:  # written when a row's step counted from 0: read as the updates done, as rows are now
        rows = {s + 1: {**row, "step": s + 1} for s, row in rows.items()}
    return [rows[s] for s in sorted(rows)]


def run_device(run_dir: str) -> str | None:
    """cpu or cuda, as the run resolved it (its config.json), or None if unknown."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    device = saved.get("device") or (saved.get("compute") or saved.get("runtime") or {}).get("device")
    return device if device in ("cpu", "cuda") else None


def stage_labels(device: str | None) -> dict[str, str]:
    """{stage: label} for a run on ``device`` (GPU names when unknown)."""
    return {s: CPU_LABELS.get(s, s) if device == "cpu" else s for s in STAGES}


def figures(run_dir: str) -> dict:
    """{file name: matplotlib Figure} of a run's plots (the caller saves and closes them)."""
    rows = read_metrics(run_dir)
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("megatrain-ray plot needs matplotlib; install it with "
                          "pip install 'megatrain-ray[plot]'.") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in rows]
    labels = stage_labels(run_device(run_dir))
    out = {}

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(steps, [r["loss"] for r in rows], color="tab:blue", label="loss")
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]  # on its step, as the loss
    if val:
        ax.plot(*zip(*val), "o-", color="tab:green", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss ({UNITS['loss']})")
    lr = ax.twinx()
    lr.plot(steps, [r["lr"] for r in rows], color="tab:orange", alpha=0.6, label="learning rate (right axis)")
    lr.set_ylabel("learning rate")
    _legend_below(ax, ax.get_lines() + lr.get_lines())
    ax.set_title(f"loss - {os.path.basename(os.path.abspath(run_dir))}")
    out["loss.png"] = fig

    fig, ax = plt.subplots(figsize=(9, 4.5))
    tokens_per_s = [r["tokens"] / max(r["step_s"], 1e-9) for r in rows]
    scales = []
    for key, (name, where) in TFLOPS_CONVENTIONS.items():  # tokens/s x FLOPs per token: one line, more scales
        ratios = [tflops(r, key) / t for r, t in zip(rows, tokens_per_s) if tflops(r, key) is not None and t > 0]
        if ratios:
            per_token = ratios[-1]
            tf = ax.secondary_yaxis(where, functions=(lambda t, k=per_token: t * k, lambda f, k=per_token: f / k))
            tf.set_ylabel(f"{UNITS[GAUGES[key]]} ({name})")
            scales.append(f"{name.split(':')[0]} {per_token * 1e12:.3g} FLOPs/token")
    label = "tokens/s (left axis)" + (f" = TFLOP/s (right axes; {', '.join(scales)})" if scales else "")
    ax.plot(steps, tokens_per_s, color="tab:blue", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(UNITS["tokens_per_s"])
    _legend_below(ax, ax.get_lines())
    ax.set_title("throughput")
    out["throughput.png"] = fig

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for stage in STAGES:
        key = "update_busy_s" if stage == "adamw" else f"{stage}_busy_s"
        if any(key in r for r in rows):
            ax.plot(steps, [r.get(key, 0.0) / max(r["step_s"], 1e-9) for r in rows], label=labels[stage])
    ax.set_ylabel(f"busy {UNITS['stage_busy_fraction']}")
    ax.set_title("stage busy time")
    ax.set_xlabel("step")
    _legend_below(ax, ax.get_lines())
    out["stages.png"] = fig

    routed = [(r["step"], r["expert_tokens"]) for r in rows if r.get("expert_tokens")]
    if routed:
        layers = next((r["expert_layers"] for r in reversed(rows) if r.get("expert_layers")), None)
        out["experts.png"] = _experts_figure(plt, routed, layers or _sparse_layers(run_dir, len(routed[-1][1])))

    timeline = os.path.join(run_dir, "timeline.json")
    intervals = []
    if os.path.isfile(timeline):
        with open(timeline) as f:
            intervals = json.load(f)
    if intervals:
        t0 = min(s[2] for s in intervals)
        fig, ax = plt.subplots(figsize=(10, 3))
        for row, stage in enumerate(STAGES):
            bars = [(s[2] - t0, s[3] - s[2]) for s in intervals if s[0] == stage]
            ax.broken_barh(bars, (row - 0.4, 0.8))
        ax.set_yticks(range(len(STAGES)), [labels[s] for s in STAGES])
        ax.set_xlabel("seconds")
        ax.set_title("stage timeline of the last two steps")
        out["timeline.png"] = fig

    for fig in out.values():
        for ax in fig.axes:
            if ax.get_xlabel() == "step":
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.tight_layout()
    return out


def expert_load(routed: list[tuple[int, list[list[int]]]]) -> tuple[list[list[float]], list[list[float]]]:
    """(load [layer][expert]: tokens over the run / the layer's mean, imbalance [step][layer]: max / mean
    tokens per expert) of (step, expert_tokens) pairs of metrics.jsonl."""
    layers = len(routed[0][1])
    totals = [[sum(step[layer][e] for _, step in routed) for e in range(len(routed[0][1][layer]))]
              for layer in range(layers)]
    load = [[t / max(sum(row) / len(row), 1e-9) for t in row] for row in totals]
    return load, [[imbalance(c) for c in step] for _, step in routed]


def _sparse_layers(run_dir: str, count: int) -> list[int]:
    """The decoder layer index of each sparse layer, from the run's config.json (rows written before
    they carried ``expert_layers``), else 0..count-1."""
    try:
        from .config import ModelConfig

        with open(os.path.join(run_dir, "config.json")) as f:
            layers = list(ModelConfig(**json.load(f)["model"]).sparse_layers)
    except Exception:  # noqa: BLE001 (an unreadable or older config: positions instead of indices)
        return list(range(count))
    return layers if len(layers) == count else list(range(count))


def _experts_figure(plt, routed, layers: list[int]):
    """The load heatmap (sparse layer x expert, idle experts marked), the imbalance and the idle experts
    per step (see the module docstring); layers: the decoder layer index of each sparse layer."""
    load, ratios = expert_load(routed)
    fig, (heat, line) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    image = heat.imshow(load, aspect="auto", cmap="viridis", interpolation="nearest")
    heat.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    experts = len(load[0])
    heat.set_xticks(range(0, experts, max(1, experts // 16)))
    never = [(e, i) for i, row in enumerate(load) for e in idle(row)]
    if never:
        heat.scatter(*zip(*never), marker="x", color="red", s=40, label="no token in the run")
        heat.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    heat.set_xlabel("expert")
    heat.set_ylabel("decoder layer (sparse)")
    heat.set_title("load over the run (tokens / layer mean)")
    fig.colorbar(image, ax=heat)
    steps = [s for s, _ in routed]
    line.plot(steps, [max(layers) for layers in ratios], color="tab:red", label="worst layer")
    line.plot(steps, [sorted(layers)[len(layers) // 2] for layers in ratios], color="tab:blue", label="median layer")
    line.axhline(1.0, color="grey", linewidth=0.8)
    line.set_xlabel("step")
    line.set_ylabel("imbalance (max / mean tokens per expert)")
    line.set_title("imbalance and idle experts per step")
    idle_axis = line.twinx()
    idle_axis.plot(steps, [sum(len(idle(c)) for c in step) for _, step in routed], color="tab:grey",
                   linestyle=":", label="idle experts (no token)")
    idle_axis.set_ylabel("idle experts (all sparse layers)")
    idle_axis.set_ylim(bottom=0)
    _legend_below(line, [*line.get_lines()[:2], *idle_axis.get_lines()])
    return fig


def _legend_below(ax, lines) -> None:
    """A legend of ``lines`` under the axes (below the x label), so it never covers the data."""
    ax.legend(handles=lines, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=min(len(lines), 5), frameon=False)


def plot_run(run_dir: str, out: str | None = None) -> list[str]:
    """Write the PNGs of a run; returns their paths."""
    import matplotlib.pyplot as plt

    figs = figures(run_dir)
    out = out or os.path.join(run_dir, "plots")
    os.makedirs(out, exist_ok=True)
    written = []
    for name, fig in figs.items():
        path = os.path.join(out, name)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
