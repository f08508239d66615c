"""The plan's expected step time against every recorded single-H200 benchmark (benchmarks/results/*/bench-*.json).

Each run's config is rebuilt as ``megatrain-ray bench`` built it (its preset, --layers and --set
overrides, :func:`megatrain_ray.bench.base_sections` and :func:`~megatrain_ray.bench.bench_config`;
settings since renamed are written under their new names, execution settings that the step's
arithmetic does not read are left out), its activation placement is the one the run recorded (the
layers kept whole; every layer recomputed where the run recorded none, as the engines of those
commits did), and :func:`megatrain_ray.orchestration.pace.expected_pace` is asked for the step time
on the recorded GPU with the units the run kept resident (:func:`_resident_layers`); a run that placed its optimizer updates (optim.placement device or auto) or held
its gradients on the GPU for the norm adds them as its plan placed them and with the AdamW threads it
ran (:func:`_recorded_updates`). Every prediction must be within 10% of the recorded steady step time
(``systems.megatrain_ray.step_s``). The runs of older commits in a side by side of code versions (benchmarks/code_side_by_side.sh's
``old-N``) are left out: the plan is the current code's; so is a run of which a later day recorded the same run
(:func:`_newest`). The rates of pace.py and gpu_work.py were fitted or measured
on these same runs (their docstrings say which); the table printed (``pytest -s``) is the one their
docstrings point to.
"""

import glob
import json
import os
import re

import pytest

from megatrain_ray.bench import base_sections, bench_config
from megatrain_ray.config.moved import MOVED
from megatrain_ray.engine.affinity import parse_cpulist
from megatrain_ray.engine.store.host_store import StoreSpec, resident_units
from megatrain_ray.io.hf_io import load_train_config
from megatrain_ray.model.layout import StoreLayout
from megatrain_ray.model.precision import resolve_precision
from megatrain_ray.orchestration import pace
from megatrain_ray.orchestration.device_memory import resolve_resident
from megatrain_ray.orchestration.placement import update_pace
from megatrain_ray.orchestration.resolve import updates_split, updates_wait_for_norm

RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")
H200_BYTES = 143_771 * 2**20
"""The H200's memory, as its recorded runs' machine.txt gives it."""
TOLERANCE = 0.10
SHAPES = {"qwen3-30b-a3b-12l-262144": (4096, 16), "qwen3-30b-a3b-48l-lora-r16-262144": (4096, 16),
          "qlora-qwen3-30b-a3b-nf4-262144": (4096, 16), "lora-32bw-100l-r16": (1024, 16), "qlora-70b-nf4-65536": (1024, 16)}
"""(train.seq_len, micro-batches) by the bench's tag, of the runs whose bench-*.json predates those fields and whose
shape is not bench's default (1,024 x 4, or one sequence of all the tokens where the run raised
max_position_embeddings to them): from the commands in each directory's NOTES.md (the Qwen3 runs'
recipes, benchmarks/moe.sh, moe_lora.sh and qlora.sh: 16 micro-batches of 4 x 4,096; the LoRA runs
of the 32B width and the 70B shape: 16 micro-batches of 4 x 1,024)."""

RECOMPUTED_EVERY_LAYER = {"qwen3-30b-a3b-12l-262144": "its NOTES.md: the log's '5 of 12 layers kept whole' is what "
                          "that commit's planner printed; its engine recomputed every sparse layer"}
"""Runs whose recorded activation placement is not what their engine ran, by the bench's tag."""

def _override(item: str) -> str | None:
    key, value = item.split("=", 1)
    if key.startswith("data.") and key != "data.pack_documents":
        return None  # the run's own data: the step's arithmetic reads only whether it packs documents
    if key.startswith("runtime."):  # renamed since; runtime.device_adamw and runtime.activations place work only
        if key[len("runtime."):] not in MOVED:
            return None
        key = MOVED[key[len("runtime."):]]
    return f"{key}={value}"


def recorded_runs() -> list[tuple[str, object, int, float, str, object, int]]:
    """(name, config, recomputed layers, measured step_s, GPU name, recorded update placement or None, resident
    parameters) of every single-H200 bench result but those :func:`_newest` leaves out."""
    dated = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "*_h200_*", "bench-*.json"))):
        if os.path.basename(path).startswith("bench-old-"):
            continue  # benchmarks/code_side_by_side.sh's runs of older commits: the plan is the current code's
        report = json.load(open(path))
        tokens, overrides = report["tokens_per_step"], report.get("overrides") or []
        if "seq_len" in report:
            seq_len, micro_batches = report["seq_len"], report["micro_batches"]
        elif report.get("name") in SHAPES:
            seq_len, micro_batches = SHAPES[report["name"]]
        elif any(o.endswith(f"max_position_embeddings={tokens}") for o in overrides):
            seq_len, micro_batches = tokens, 1
        else:
            seq_len, micro_batches = 1024, 4
        cfg = bench_config(base_sections(report["preset"], None, None, report["layers"]), tokens, seq_len,
                           micro_batches, 3, None, [o for o in map(_override, overrides) if o])
        dated.append((os.path.basename(os.path.dirname(path))[:len("2026-12-01")], (path, report, cfg)))
    return [_recorded_run(*run) for run in _newest(dated)] + [_long_context()]


def _recorded_run(path: str, report: dict, cfg) -> tuple[str, object, int, float, str, object, int]:
    """One bench result (``path``, its ``report`` and rebuilt ``cfg``) as :func:`recorded_runs` gives it: the
    activation placement, update placement and resident units it recorded."""
    ours, overrides = report["systems"]["megatrain_ray"], report.get("overrides") or []
    kept = re.search(r"(\d+) of \d+ layers kept whole", ours.get("activations", ""))
    kept = 0 if kept is None or report.get("name") in RECOMPUTED_EVERY_LAYER else int(kept.group(1))
    placed, plan = None, None
    if any(o.startswith("optim.placement=") and o != "optim.placement=host" for o in overrides):
        tag = os.path.basename(path)[len("bench-"):-len(".json")]
        plan = os.path.join(os.path.dirname(path), f"plan-{tag}.txt")
        placed = _recorded_updates(cfg, plan, ours.get("cpu_placement") or [])
    elif _holds_grads(cfg):
        placed = _recorded_updates(cfg, None, ours.get("cpu_placement") or [])
    directory = os.path.basename(os.path.dirname(path))
    return (f"{directory[len('2026-12-01_h200_'):]}/{os.path.basename(path)[6:-5]}", cfg,
            cfg.model.num_hidden_layers - kept, ours["step_s"], report["device"], placed, _resident_params(cfg, plan))


def _newest(dated: list[tuple[str, tuple]]) -> list[tuple]:
    """The results of ``dated`` ((date, (path, report, config)) pairs) but those of which a later day recorded
    the same run (the same config on the same GPU): the newer one measured the code the plan is closer to,
    with the activation placement, resident units and update placement that code chose for it."""
    keyed = [(day, json.dumps([run[2].to_dict(), run[1]["device"]], sort_keys=True, default=str), run)
             for day, run in dated]
    last = {}
    for day, key, _ in keyed:
        last[key] = max(last.get(key, day), day)
    return [run for day, key, run in keyed if day == last[key]]


def _resident_layers(cfg, plan_path: str | None) -> int | None:
    """The decoder layers a run kept resident: those its plan (``plan_path``) grew to with memory.resident
    auto, else the config's first fit (:func:`~megatrain_ray.orchestration.device_memory.resolve_resident`)."""
    grown = re.search(r"memory\.resident=auto: embed_head, resident_layers (\d+)",
                      open(plan_path).read()) if plan_path is not None else None
    return int(grown.group(1)) if grown else resolve_resident(cfg, "cuda", H200_BYTES)


def _resident_params(cfg, plan_path: str | None) -> int:
    """The parameters of the units a run kept resident on the GPU (:func:`_resident_layers`)."""
    layout = StoreLayout.build(cfg.model)
    return sum(layout.templates[u].numel for u in resident_units(cfg.model, _resident_layers(cfg, plan_path)))


def _holds_grads(cfg) -> bool:
    """Whether a run's store held the step's gradients on the GPU for the norm (experimental.hold_grads:
    bf16 master weights or the 8-bit state, with clipping)."""
    resident = resident_units(cfg.model, resolve_resident(cfg, "cuda", H200_BYTES))
    return StoreSpec.of_run(cfg, resolve_precision(cfg.precision, "cuda", cfg.optim.state), "cuda", 0, "plan",
                            resident).hold_grads


def _recorded_updates(cfg, plan_path: str | None, placement: list[str]):
    """The update placement a run recorded, as an :class:`~megatrain_ray.orchestration.pace.UpdatePace`:
    the units its plan (``plan_path``, the plan its recipe printed beside it, of a run of optim.placement
    device or auto; None: optim.placement host) put on the device (the first units, as auto moves them
    where the device's updates run beside the next forward; the last in the runs recorded before)
    and on the host, whether it held the gradients for the norm, and the AdamW threads its cpu placement
    line gave the sink ("AdamW on CPUs 4-15": one per CPU)."""
    spans = re.search(r"AdamW on CPUs ([\d,-]+)", " ".join(placement))
    assert spans, f"{plan_path or 'a run'}: its cpu placement does not say where the updates ran"
    threads = len(parse_cpulist(spans.group(1)))
    layout = StoreLayout.build(cfg.model)
    plan = open(plan_path).read() if plan_path is not None else ""
    resident = resident_units(cfg.model, _resident_layers(cfg, plan_path))
    streamed = [u for u in range(len(layout.units)) if u not in resident]
    on_device = []
    if plan_path is not None:
        where = re.search(r"updated where: (\d+) units on the host's CPU threads, (\d+) streamed units on the device",
                          plan)
        assert where, f"{plan_path} does not say where the updates ran"
        moved = int(where.group(2))  # the first units where the device's updates lead the next forward, else the last
        on_device = streamed[:moved] if "beside the next forward" in plan else streamed[len(streamed) - moved:]
        assert len(streamed) - len(on_device) == int(where.group(1)), (plan_path, on_device)
    host = [u for u in streamed if u not in on_device]
    precision = resolve_precision(cfg.precision, "cuda", cfg.optim.state)
    store = StoreSpec.of_run(cfg, precision, "cuda", 0, "plan", resident)
    return update_pace(layout, host, threads, on_device, precision, store.hold_grads, updates_wait_for_norm(cfg),
                       updates_split(cfg, precision, store))


def expected_step_s(cfg, recomputed: int, gpu: str, placed, resident_params: int = 0) -> tuple[float, object]:
    """The plan's expected step time of a recorded run (and its pace): the device's step at the recorded
    activation placement with its resident units' parameters (``resident_params``, updated on the GPU)
    and, for a run that placed its updates (optim.placement device or auto) or held its
    gradients (``placed``, :func:`_recorded_updates`), the longer of that step with its device updates and
    the host's path (:meth:`~megatrain_ray.orchestration.pace.UpdatePace.step_s`)."""
    p = pace.expected_pace(cfg, "cuda", recomputed, gpu_name=gpu, resident_params=resident_params)
    return (p.step_s if placed is None else placed.step_s(p)), p


def _long_context() -> tuple[str, object, int, float, str, None, int]:
    """configs/long-context-512k.yaml's one step (2026-12-01_h200_long-context-512k: metrics.jsonl, its
    only step, compile included; plan.txt: no layer kept whole, every one recomputed)."""
    directory = os.path.join(RESULTS, "2026-12-01_h200_long-context-512k")
    step = json.loads(open(os.path.join(directory, "metrics.jsonl")).readline())
    placement = open(os.path.join(directory, "plan.txt")).read()
    kept = int(re.search(r"(\d+) layers kept whole", placement).group(1))
    cfg = load_train_config(os.path.join(os.path.dirname(__file__), "..", "configs", "long-context-512k.yaml"),
                            skip=("data",))
    gpu = re.search(r"the (NVIDIA [^']+)'s nominal", placement).group(1)
    return ("long-context-512k/train", cfg, cfg.model.num_hidden_layers - kept, step["step_s"], gpu, None,
            _resident_params(cfg, None))


def test_the_expected_step_time_is_within_a_tenth_of_every_recorded_h200_step():
    runs = recorded_runs()
    assert len(runs) >= 24, "the recorded H200 results are missing"
    rows, misses = [], []
    for name, cfg, recomputed, measured, gpu, placed, resident_params in runs:
        step_s, p = expected_step_s(cfg, recomputed, gpu, placed, resident_params)
        ratio = step_s / measured
        parts = " ".join(f"{what} {s:.2f}" for what, _, s in p.parts if s)
        rows.append(f"| {name} | {measured:.2f} | {step_s:.2f} | {ratio - 1:+.1%} | {parts} fixed {p.fixed_s:.2f} "
                    f"link {p.link_s:.2f}{' with the updates placed' if step_s != p.step_s else ''} |")
        if abs(ratio - 1) > TOLERANCE:
            misses.append(name)
    print("\n| run | measured s | expected s | off | seconds by part |\n|---|---|---|---|---|\n" + "\n".join(rows))
    assert not misses, (f"more than {TOLERANCE:.0%} off: {misses}\n"
                        + "\n".join(rows))
