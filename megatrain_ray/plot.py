"""``megatrain-ray plot RUN_DIR``: PNG plots of a run's metrics.jsonl (and timeline.json).

- ``loss.png``: training loss per step (and the validation loss, with train.eval_every), learning
  rate on a second axis;
- ``throughput.png``: tokens/s and model TFLOP/s per step;
- ``stages.png``: busy share of each step per pipeline stage (h2d, compute, d2h, wait, adamw);
  stages overlap in time, so the shares do not add up to one;
- ``timeline.png``: the spans of the run's last two steps, one row per stage (when the run
  finished and wrote timeline.json).

Needs matplotlib (``pip install 'megatrain-ray[plot]'``).
"""

from __future__ import annotations

import json
import os

from .errors import ConfigError

STAGES = ("h2d", "compute", "d2h", "wait", "adamw")


def read_metrics(run_dir: str) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl, one per step (the last row wins if a step repeats)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"{run_dir!r} has no metrics.jsonl; pass a run directory (runs/<run id>).")
    rows: dict[int, dict] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows[int(row["step"])] = row
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"line {n} of {path} is not a metrics row (JSON with a step).") from None
    if not rows:
        raise ConfigError(f"{path} has no rows yet: the run has not finished a step.")
    return [rows[s] for s in sorted(rows)]


def plot_run(run_dir: str, out: str | None = None) -> list[str]:
    """Write the PNGs of a run; returns their paths."""
    rows = read_metrics(run_dir)
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("megatrain-ray plot needs matplotlib; install it with "
                          "pip install 'megatrain-ray[plot]'.") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out = out or os.path.join(run_dir, "plots")
    os.makedirs(out, exist_ok=True)
    steps = [r["step"] + 1 for r in rows]
    written = []

    def save(fig, name: str) -> None:
        path = os.path.join(out, name)
        for ax in fig.axes:
            if ax.get_xlabel() == "step":
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(steps, [r["loss"] for r in rows], color="tab:blue", label="loss")
    val = [(r["step"] + 1, r["val_loss"]) for r in rows if "val_loss" in r]  # on its step, as the loss
    if val:
        ax.plot(*zip(*val), "o-", color="tab:green", label="validation loss")
        ax.legend(loc="upper right")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    lr = ax.twinx()
    lr.plot(steps, [r["lr"] for r in rows], color="tab:orange", alpha=0.6, label="learning rate")
    lr.set_ylabel("learning rate")
    ax.set_title(f"loss - {os.path.basename(os.path.abspath(run_dir))}")
    save(fig, "loss.png")

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(steps, [r["tokens"] / max(r["step_s"], 1e-9) for r in rows], label="tokens/s")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s")
    if all("model_tflops" in r for r in rows):
        tf = ax.twinx()
        tf.plot(steps, [r["model_tflops"] for r in rows], color="tab:green", linestyle="--", alpha=0.7)
        tf.set_ylabel("model TFLOP/s")
    ax.set_title("throughput")
    save(fig, "throughput.png")

    fig, ax = plt.subplots(figsize=(8, 4))
    for stage in STAGES:
        key = "update_busy_s" if stage == "adamw" else f"{stage}_busy_s"
        if any(key in r for r in rows):
            ax.plot(steps, [r.get(key, 0.0) / max(r["step_s"], 1e-9) for r in rows], label=stage)
    ax.set_xlabel("step")
    ax.set_ylabel("busy share of the step")
    ax.legend(loc="upper right")
    ax.set_title("stage busy time")
    save(fig, "stages.png")

    timeline = os.path.join(run_dir, "timeline.json")
    if os.path.isfile(timeline):
        with open(timeline) as f:
            spans = json.load(f)
        if spans:
            t0 = min(s[2] for s in spans)
            fig, ax = plt.subplots(figsize=(10, 3))
            for row, stage in enumerate(STAGES):
                bars = [(s[2] - t0, s[3] - s[2]) for s in spans if s[0] == stage]
                ax.broken_barh(bars, (row - 0.4, 0.8))
            ax.set_yticks(range(len(STAGES)), STAGES)
            ax.set_xlabel("seconds")
            ax.set_title("stage timeline of the last two steps")
            save(fig, "timeline.png")
    return written
