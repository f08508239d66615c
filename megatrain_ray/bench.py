"""Benchmark: what a run of this model does on this machine (s/step, tokens/s, TFLOPS, memory).

    megatrain-ray bench                                            # a GPU: the 1b preset; no GPU: the tiny one, ~1 min
    megatrain-ray bench --preset 7b --steps 5 --out OUT
    megatrain-ray bench --config run.yaml --steps 5 --out OUT      # the model and execution sections of a run config
    megatrain-ray bench --model path/to/hf_model --set model.num_hidden_layers=8 --out OUT
    megatrain-ray bench --preset 7b --gpus 1,2 --out OUT           # 1 and 2 GPUs in one call

The model is a preset (:mod:`megatrain_ray.model.presets`; ``tiny`` is the model ``train`` runs with
no arguments), a run config's (its model, optim and execution sections; random weights) or a
Hugging Face config.json's, then ``--layers`` and ``--set`` overrides. What is not given follows the
machine (:data:`DEFAULTS`): with a GPU, the 1b preset at 65,536 tokens a step (4 micro-batches of
16 x 1024, the README's Performance table's shape); without one, the tiny preset at train's tiny step
(1,024 tokens: 2 micro-batches of 8 x 64), which finishes in about a minute on a small CPU; the parameter count and
the random tokens' vocabulary are those of the final config. Runtime settings not given keep the
library's defaults, so ``train`` with the same config runs what the benchmark measured.

Reports steady-state seconds per step, tokens/s and model TFLOPS in both conventions of
:mod:`megatrain_ray.model.flops` (``tflops_6nt``: 6·N·T; ``tflops_palm``: PaLM's, with attention),
the GPU peak, the host memory the run added (:mod:`megatrain_ray.hostmem`) and where each
step's time went, printed as a table and written to ``OUT/bench-<name>.json`` with a timeline PNG.
Comparisons with other systems (GPU-resident PyTorch, DeepSpeed, FSDP2) are a harness outside the
package: ``python benchmarks/compare.py`` (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch

from .config import EXECUTION_SECTIONS, TrainConfig, load_config
from .errors import ConfigError
from .io.hf_io import load_train_config, read_config
from .model import flops as model_flops
from .model.layout import StoreLayout
from .model.presets import PRESETS, preset_model
from .hostmem import HostMemoryPeak
from .orchestration.machine import guess_device

DEFAULTS = {"cuda": dict(preset="1b", tokens=65536, seq_len=1024, micro_batches=4),
            "cpu": dict(preset="tiny", tokens=1024, seq_len=64, micro_batches=2)}
"""What the benchmark runs when its arguments do not say, per device (compute.device, or the GPU
this machine has): the model when neither --preset, --config nor --model is given, and the step shape."""


def base_sections(preset: str | None, config: str | None, model_dir: str | None, layers: int | None) -> dict:
    """The config sections a benchmark starts from: a preset's model; a run config's model, optim and
    the sections of how it executes (its train.init_from's shape, with random weights; its train and
    data sections are not read: the benchmark trains on random tokens); or an HF directory's config.json."""
    if sum(x is not None for x in (preset, config, model_dir)) > 1:
        raise ConfigError("give one of --preset, --config and --model, not several.")
    if config is not None:
        cfg = load_train_config(config, skip=("data",))
        base = {name: dataclasses.asdict(getattr(cfg, name)) for name in EXECUTION_SECTIONS + ("model", "optim")}
    elif model_dir is not None:
        base = {"model": dataclasses.asdict(read_config(model_dir, "--model")[0])}
    else:
        base = {"model": dataclasses.asdict(preset_model(preset or DEFAULTS["cuda"]["preset"]))}
    if layers:
        model = base["model"]
        model["num_hidden_layers"] = layers
        if model.get("layer_types"):  # per-layer attention (gpt-oss): the first layers', cycled where deeper
            model["layer_types"] = [model["layer_types"][i % len(model["layer_types"])] for i in range(layers)]
    return base


def bench_config(base: dict, tokens: int, seq_len: int, micro_batches: int, steps: int, data: str | None,
                 extra: list[str]) -> TrainConfig:
    """The run the benchmark trains: ``base`` (see :func:`base_sections`) with the step shape, random
    tokens at ``data`` (None: the built-in corpus, to learn the final model before drawing them),
    no checkpoints, then ``extra`` (``--set``) overrides; execution settings not set stay the library's."""
    mbs = tokens // (seq_len * micro_batches)
    return load_config(None, [
        f"train.seq_len={seq_len}", f"train.micro_batch_size={mbs}", f"train.num_micro_batches={micro_batches}",
        f"train.steps={steps}", *([f"data.path={data}"] if data else []),
        "optim.lr=1e-4", "optim.weight_decay=0.1", "optim.warmup_steps=0", "train.checkpoint_every=0",
        "train.checkpoint_on_interrupt=false", "train.save_final=false", *extra], base=base)


def random_tokens(path: str, vocab_size: int, n: int = 4_000_000) -> str:
    """Write ``n`` uniformly random token ids below ``vocab_size`` as a .npy file; returns ``path``."""
    np.save(path, np.random.default_rng(0).integers(0, vocab_size, size=n))
    return path


def _with_workers(base: dict, shape: tuple, data: str, extra: list[str], tmp: str, n: int) -> TrainConfig:
    """The benchmark's run on ``n`` compute workers, each with the step shape of one (weak scaling)."""
    tokens, seq_len, micro_batches, steps = shape
    return bench_config(base, tokens * n, seq_len, micro_batches * n, steps, data,
                        [*extra, f"train.run_dir={tmp}/runs", f"parallel.compute_workers={n}"])


def summarize(rows: list[dict]) -> dict:
    """Steady-state numbers from per-step rows (the warm-up steps are left out).

    A step's period is the time between the end of its run_step and the previous step's (the
    driver keeps steps queued, so this is the pipeline's throughput, overlap included); s/step is
    the median period of the steps after the warm-up: with 5 steps, of the last 3. A step that
    torch.profiler recorded (train.profile_steps: its row names its profile) is left out, and so is
    the step after it: the profiler slows the one, and writing its trace the next one's start.
    """
    warm = 2 if len(rows) > 3 else 1  # the first steps fault pages in and warm caches up
    steady = [r for r in rows[warm:] if "profile" not in r] or rows
    ends = [r["start"] + r["step_s"] for r in rows]
    periods = [b - a for i, (a, b) in enumerate(zip(ends, ends[1:]))  # step i+1's period, after step i's end
               if i >= warm - 1 and not ("profile" in rows[i] or "profile" in rows[i + 1])] or [rows[-1]["step_s"]]
    med = lambda key: statistics.median(r.get(key, 0.0) for r in steady)  # noqa: E731
    step_s = statistics.median(periods)
    out = {"step_s": step_s, "steady_periods": len(periods), "losses": [r["loss"] for r in rows],
           "fetches": rows[-1]["fetches"],
           "tokens": rows[-1]["tokens"], "device_peak_gib": max(r["device_peak_bytes"] for r in rows) / 2**30}
    for lane in ("compute", "h2d", "d2h", "update", "device_update", "wait"):  # update: the host's AdamW
        out[f"{lane}_busy_frac"] = med(f"{lane}_busy_s") / step_s
    out["outside_run_step_s"] = step_s - med("step_s")
    out["h2d_gbps"] = med("h2d_bytes") / max(med("h2d_busy_s"), 1e-9) / 1e9
    out["d2h_gbps"] = med("d2h_bytes") / max(med("d2h_busy_s"), 1e-9) / 1e9
    return out


def run_pipeline(cfg) -> tuple[dict, list[tuple]]:
    """Train through the Ray actor pipeline; returns the summary and the last step's timeline."""
    from .orchestration.pipeline import train

    t0 = time.perf_counter()
    placement: list[str] = []  # its lines on where threads run (experimental.cpu_affinity) and activations wait
    with HostMemoryPeak(shm_dir=cfg.memory.shm_dir) as mem:
        def log(line: str) -> None:  # the run's lines as its progress; where threads and activations went kept
            print(f"  {line}", flush=True)
            if line.lstrip().startswith("step"):
                mem.sample()  # the store surely exists while steps log, whatever the sampler's timing
            if line.startswith(("cpu placement", "activations")):
                placement.append(line)

        result = train(cfg, log=log)
    wall_s = time.perf_counter() - t0
    with open(os.path.join(result.run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    for r in rows:
        r["device_peak_bytes"] = r.get("device_peak_bytes", 0)
    summary = summarize(rows)
    summary["rows"] = rows
    summary.update(mem.summary(StoreLayout.build(cfg.model).num_params))
    summary["wall_s"] = wall_s
    summary["cpu_placement"] = [line for line in placement if line.startswith("cpu placement")]
    summary["activations"] = next((line for line in placement if line.startswith("activations")), None)
    summary["outside_steps_s"] = wall_s - sum(r["step_s"] for r in rows)  # start-up and shut-down
    return summary, result.timeline


def plot_timeline(intervals: list[tuple], path: str) -> None:
    """One PNG row per lane (h2d, compute, d2h, adamw) of one step's intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = ["wait", "h2d", "compute", "d2h", "device_update", "adamw"]  # device_update: optim.placement device
    t0 = min(s[2] for s in intervals)
    fig, ax = plt.subplots(figsize=(14, 3.2))
    colors = {"h2d": "tab:blue", "compute": "tab:green", "d2h": "tab:orange", "adamw": "tab:red",
              "wait": "tab:gray", "device_update": "tab:purple"}
    for lane, label, start, end, _ in intervals:
        y = lanes.index(lane)
        ax.broken_barh([(start - t0, end - start)], (y - 0.4, 0.8), color=colors[lane], alpha=0.8)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("seconds")
    ax.set_title("megatrain_ray: the last two training steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def format_systems(systems: dict[str, dict]) -> str:
    """One row per system: s/step, tok/s, TFLOPS (6·N·T and PaLM's), megatrain_ray's speed over it, GPU
    and host memory, and the status of runs that did not finish (oom, timeout, error)."""
    ours = systems["megatrain_ray"]["step_s"]
    lines = [f"{'system':<22}{'s/step':>8}{'tok/s':>9}{'TF 6NT':>8}{'TF PaLM':>8}{'ours x':>8}{'GPU GiB':>9}"
             f"{'host GiB':>9}  status"]
    for name, r in systems.items():
        gpu = r.get("device_peak_gib", r.get("peak_gpu_gib", r.get("gpu_peak_gib")))
        host = r.get("host_peak_added_gib")
        cells = [f"{r['step_s']:>8.3f}", f"{r['tokens_per_s']:>9,.0f}", f"{r['tflops_6nt']:>8.1f}",
                 f"{r['tflops_palm']:>8.1f}", f"{r['step_s'] / ours:>8.2f}"] if math.isfinite(r["step_s"]) else [
                     f"{'-':>8}", f"{'-':>9}", f"{'-':>8}", f"{'-':>8}", f"{'-':>8}"]
        cells += [f"{gpu:>9.1f}" if gpu is not None else f"{'-':>9}", f"{host:>9.1f}" if host is not None else f"{'-':>9}"]
        lines.append(f"{name:<22}{''.join(cells)}  {r.get('status', 'ok')}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command's options (benchmarks/compare.py adds its comparisons to them)."""
    ap = argparse.ArgumentParser(prog="megatrain-ray bench", description=__doc__.split("\n")[0])
    what = ap.add_argument_group("what to benchmark (one of; default --preset 1b with a GPU, tiny without)")
    what.add_argument("--preset", choices=sorted(PRESETS), help="a built-in model shape")
    what.add_argument("--config", help="a run config (YAML): its model, optim and execution sections, random weights")
    what.add_argument("--model", metavar="HF_MODEL_DIR", help="a Hugging Face model directory: its config.json's shape")
    ap.add_argument("--layers", type=int, default=None, help="override the model's number of decoder layers")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens per optimizer step (default: 65536 with a GPU, 1024 without)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: 1024 with a GPU, 64 without)")
    ap.add_argument("--micro-batches", type=int, default=None,
                    help="micro-batches per step, each of --tokens / (--seq-len x this) sequences "
                         "(default: 4 with a GPU, 2 without)")
    ap.add_argument("--steps", type=int, default=5,
                    help="optimizer steps to time; the first ones warm up and are left out (default: 5)")
    ap.add_argument("--gpus", default="1", metavar="N[,N...]",
                    help="compute workers (GPUs) per run, comma-separated to compare counts in one run (e.g. 1,2): "
                         "each GPU takes --tokens and --micro-batches of its own (weak scaling); the first count "
                         "is the 'megatrain_ray' row")
    ap.add_argument("--buffer-depth", type=int, default=None, help="memory.buffer_depth (default: the library's)")
    ap.add_argument("--master-dtype", default=None, help="precision.master_dtype (default: the library's)")
    ap.add_argument("--max-grad-norm", type=float, default=None, help="optim.max_grad_norm (default: the library's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for our runs (repeatable), e.g. compute.compile=false or model.vocab_size=32000")
    ap.add_argument("--tag", default=None, help="name of this run's output files (default: the preset, config or model name)")
    ap.add_argument("--out", default=".", help="directory for bench-<name>.json and the timeline PNG")
    return ap


@dataclasses.dataclass
class Bench:
    """One benchmark call resolved from its arguments: the model, the step shape, the overrides."""

    args: argparse.Namespace
    base: dict
    extra: list[str]
    shape: tuple  # (tokens, seq_len, micro_batches, steps)
    model: object  # the final ModelConfig, --set model.* included
    preset: str | None
    name: str
    report: dict

    @property
    def counts(self) -> list[int]:
        return [int(n) for n in self.args.gpus.split(",")]

    def config(self, data: str, tmp: str, workers: int = 1) -> TrainConfig:
        """The run on ``workers`` compute workers, each with the step shape of one (weak scaling)."""
        if workers == 1:
            return bench_config(self.base, *self.shape, data, [*self.extra, f"train.run_dir={tmp}/runs"])
        return _with_workers(self.base, self.shape, data, self.extra, tmp, workers)


def setup(args: argparse.Namespace) -> Bench:
    """Resolve the arguments; every error is raised here, before any work or output."""
    from .orchestration.cluster import job_path

    device = guess_device(load_config(None, [s for s in args.set if s.startswith("compute.device=")]))
    defaults = DEFAULTS["cuda" if device == "cuda" else "cpu"]
    if args.preset is None and args.config is None and args.model is None:
        args.preset = defaults["preset"]
    for key in ("tokens", "seq_len", "micro_batches"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    base = base_sections(args.preset, args.config, args.model, args.layers)
    extra = [*([f"memory.buffer_depth={args.buffer_depth}"] if args.buffer_depth else []),
             *([f"precision.master_dtype={args.master_dtype}"] if args.master_dtype else []),
             *([f"optim.max_grad_norm={args.max_grad_norm}"] if args.max_grad_norm is not None else []), *args.set]
    shape = (args.tokens, args.seq_len, args.micro_batches, args.steps)
    model = bench_config(base, *shape, None, extra).model
    preset = args.preset
    name = args.tag or preset or (os.path.splitext(os.path.basename(args.config))[0] if args.config
                                  else os.path.basename(os.path.normpath(args.model)))
    args.out = job_path(args.out, "--out")
    report = {"preset": preset, "name": name, "model": dataclasses.asdict(model),
              "layers": model.num_hidden_layers, "params": StoreLayout.build(model).num_params,
              "overrides": args.set, "tokens_per_step": args.tokens, "seq_len": args.seq_len,
              "micro_batches": args.micro_batches,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    return Bench(args, base, extra, shape, model, preset, name, report)


def run_ours(b: Bench, cfg: TrainConfig, data: str, tmp: str) -> tuple[dict, dict]:
    """Our pipeline at each GPU count of ``--gpus``: ({system: summary}, {system: tokens per step});
    the first count's rows and timeline go into the report (and its PNG next to the JSON)."""
    os.makedirs(b.args.out, exist_ok=True)
    device = guess_device(cfg)  # as the driver resolves it on a one-node cluster
    b.report.update(max_grad_norm=cfg.optim.max_grad_norm, buffer_depth=cfg.memory.buffer_depth_on(device),
                    loss_chunk_size=cfg.memory.loss_chunk_size_on(device), master_dtype=cfg.precision.master_dtype,
                    optim_state=cfg.optim.state, hold_grads=cfg.experimental.hold_grads_on(device))
    counts, tokens = b.counts, b.args.tokens
    systems, tokens_of = {}, {"megatrain_ray": tokens * counts[0]}
    systems["megatrain_ray"], timeline = run_pipeline(cfg if counts[0] == 1 else b.config(data, tmp, counts[0]))
    for n in counts[1:]:
        systems[f"megatrain_ray_{n}gpu"] = run_pipeline(b.config(data, tmp, n))[0]
        systems[f"megatrain_ray_{n}gpu"].pop("rows")
        tokens_of[f"megatrain_ray_{n}gpu"] = tokens * n
    rows = systems["megatrain_ray"].pop("rows")
    b.report["rows"] = rows
    for r in rows:  # train.profile_steps: each profile goes beside the report, out of the run's temporary directory
        if "profile" in r:
            shutil.copytree(r["profile"], os.path.join(b.args.out, f"profile-{b.name}", os.path.basename(r["profile"])),
                            dirs_exist_ok=True)
    print("step  start(s)  run_step(s)  waiting(s)  compute(s)  adamw(s)")
    for r in rows:
        print(f"{r['step']:>4}{r['start'] - rows[0]['start']:>10.3f}{r['step_s']:>13.3f}"
              f"{r.get('wait_busy_s', 0):>12.3f}{r['compute_busy_s']:>12.3f}{r['update_busy_s']:>10.3f}")
    b.report["timeline"] = timeline
    try:
        plot_timeline(timeline, os.path.join(b.args.out, f"timeline-{b.name}.png"))
    except ImportError:
        print("matplotlib is not installed: no timeline PNG")
    return systems, tokens_of


def finish(b: Bench, cfg: TrainConfig, systems: dict, tokens_of: dict) -> int:
    """Tokens/s and TFLOPS (both conventions; MFU where the report has a measured GEMM rate) of every
    system, the JSON written, the table and our step's breakdown printed."""
    args, report = b.args, b.report
    for key, r in systems.items():
        tokens = tokens_of.get(key, args.tokens)
        r.setdefault("step_s", float("nan"))
        r["tokens_per_step"] = tokens
        r["tokens_per_s"] = tokens / r["step_s"]
        lora = cfg.lora if key.startswith("megatrain_ray") else None  # ours: a LoRA run's FLOPs as it runs them
        r.update(model_flops.tflops(cfg.model, args.seq_len, tokens, r["step_s"], lora))  # tflops_6nt, _palm
        if "gemm_tflops" in report:  # per GPU: against one GPU's GEMM times the GPUs the run used
            gpus = tokens // args.tokens if key.startswith("megatrain_ray") else 1
            r["mfu"] = r["tflops_palm"] / (report["gemm_tflops"] * gpus)
    report["systems"] = systems
    with open(os.path.join(args.out, f"bench-{b.name}.json"), "w") as f:
        json.dump(report, f, indent=2)
    ours, counts = systems["megatrain_ray"], b.counts
    print(f"\n{b.name}: {model_flops.fmt_count(report['params'])} params ({report['layers']} layers, vocabulary "
          f"{b.model.vocab_size}), {args.tokens} tokens/step{' per GPU' if max(counts) > 1 else ''}, {report['device']}")
    print(format_systems(systems))
    for n in counts[1:]:
        many = systems[f"megatrain_ray_{n}gpu"]
        print(f"{n} GPUs: {many['tokens_per_s']:,.0f} tokens/s = {many['tokens_per_s'] / ours['tokens_per_s']:.2f}x "
              f"{counts[0]} GPU(s) in this run ({n * args.tokens} tokens/step, {many['step_s']:.2f} s/step)")
    print("ours, share of the step: " + ", ".join(
        f"{lane} {ours[f'{lane}_busy_frac']:.0%}" for lane in ("compute", "h2d", "d2h", "update", "wait"))
        + f"; {ours['outside_run_step_s']:.3f} s/step outside run_step"
        + (f"; start-up + shut-down {ours['outside_steps_s']:.0f} s" if "outside_steps_s" in ours else "")
        + f"; host memory added {ours['host_peak_added_gib']:.1f} GiB = {ours['host_bytes_per_param']:.1f} B/param"
        + f" (peak RSS + shm {ours['host_accounted_gib']:.1f} GiB = {ours['host_accounted_bytes_per_param']:.1f} B/param:"
        + f" shm {ours['host_accounted_shm_gib']:.1f}, processes {ours['host_accounted_processes_gib']:.1f})"
        + f"; link {ours['h2d_gbps']:.0f} GB/s in, {ours['d2h_gbps']:.0f} GB/s out")
    if ours.get("activations"):
        print("ours, " + ours["activations"])
    for key, r in systems.items():
        if key.startswith("megatrain_ray") and r["steady_periods"] < 3:
            print(f"note: {key}'s s/step is the median of only {r['steady_periods']} step(s) after the warm-up; "
                  "use --steps 5 or more for numbers to quote")
    print(f"ours: {ours['tflops_6nt']:.1f} TFLOPS as 6·N·T (every parameter a token goes through), {ours['tflops_palm']:.1f} as PaLM's "
          "model FLOPs (matmul parameters + attention)"
          + (f", MFU {ours['mfu']:.1%} of the bf16 GEMM measured in this run ({report['gemm_tflops']:.0f} TFLOP/s)"
             if "mfu" in ours else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    b = setup(parser().parse_args(argv))
    with tempfile.TemporaryDirectory() as tmp:
        data = random_tokens(os.path.join(tmp, "tokens.npy"), b.model.vocab_size)
        cfg = b.config(data, tmp)
        systems, tokens_of = run_ours(b, cfg, data, tmp)
    return finish(b, cfg, systems, tokens_of)


if __name__ == "__main__":
    raise SystemExit(main())
