"""Observability: Ray metrics scraped from the node's Prometheus endpoint, metrics.jsonl, plots.

One real run through the pipeline (session Ray: ``include_dashboard=False`` still runs the
metrics agent), then: every ``ray_megatrain_*`` gauge, and every metric the shipped Grafana
dashboard reads, is on the endpoint with this run's id and the values of its last step;
``megatrain-ray plot`` turns its metrics.jsonl into PNGs whose series are those gauges, in their units;
the step it profiled (train.profile_steps) left its trace and summary where its row says.
"""

import gzip
import json
import os
import re
import time
import urllib.request

import pytest
import ray
import torch

from megatrain_ray import cli
from megatrain_ray.config import load_config
from megatrain_ray.engine.store.host_store import StoreSpec
from megatrain_ray.model import flops
from megatrain_ray.model.precision import Precision
from megatrain_ray.orchestration import grafana
from megatrain_ray.orchestration.gauges import MOE_GAUGES, STAGE_ROLE, UNITS
from megatrain_ray.orchestration.pipeline import train
from megatrain_ray.progress import ETA_STEPS

STEPS = 4
GAUGES = ("tokens_per_s", "tflops_6nt", "tflops_palm", "step_time_s", "loss", "learning_rate", "grad_norm", "step",
          "checkpoint_step", "host_store_bytes", "host_memory_used_bytes", "device_peak_bytes", "stage_busy_s",
          "stage_busy_fraction", "link_gbps", "queue_depth", "val_loss", "worker_busy_fraction", "worker_link_gbps", "role_step", "role_unit")


def grafana_metrics() -> set[str]:
    """Every ``ray_megatrain_*`` metric that a query of the shipped Grafana file reads (prefix dropped)."""
    with open(grafana.SHIPPED) as f:
        board = json.load(f)
    exprs = [t["expr"] for panel in board["panels"] for t in panel["targets"]]
    return {m for e in exprs for m in re.findall(r"ray_megatrain_(\w+)", e)}


@pytest.fixture(scope="module")
def finished_run(ray_cluster, tmp_path_factory, shm_dirs):
    base = tmp_path_factory.mktemp("metrics")
    with shm_dirs() as shm_dir:
        cfg = load_config(None, [f"memory.shm_dir={shm_dir}", f"train.run_dir={base / 'runs'}", "compute.device=cpu",
                                 f"train.steps={STEPS}", "train.checkpoint_every=2", "cluster.actor_timeout_s=120",
                                 "train.eval_every=2", "data.val_fraction=0.1", "data.format=text",
                                 "train.profile_steps=3"])
        lines = []
        result = train(cfg, log=lines.append)
        assert os.listdir(shm_dir) == []
    # Scraped once, at once: Ray's metrics agent drops the metrics of a process that has not reported for
    # RAY_WORKER_TIMEOUT_S (120 s), the run's roles' (gone) and the driver's once it sets no gauge; so
    # whatever the tests run before them, the tests read what the endpoint showed as the run ended.
    text = []
    return cfg, result, lines, _scrape(result.run_id, STEPS, text=text), text[-1]


def _scrape(run_id: str, final_step: int, timeout: float = 90.0, wanted: set[str] | None = None,
            text: list | None = None) -> dict[tuple[str, tuple], float]:
    """{(metric name, sorted extra tags): value} of this run's ray_megatrain_* samples on the node,
    once the exporter shows every gauge at the run's final step (it exports every few seconds);
    wanted: the gauges to wait for (default: every gauge a dense run sets and the dashboard reads);
    text: a list left holding the endpoint's last page."""
    wanted = (set(GAUGES) | grafana_metrics()) - set(MOE_GAUGES) if wanted is None else wanted
    node = next(n for n in ray.nodes() if n["Alive"])
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    deadline = time.monotonic() + timeout
    found: dict[tuple[str, tuple], float] = {}
    while time.monotonic() < deadline:
        page = urllib.request.urlopen(url, timeout=10).read().decode()
        if text is not None:
            text[:] = [page]
        found = {}
        for m in re.finditer(r'^ray_megatrain_(\w+)\{([^}]*)\} (\S+)$', page, re.M):
            tags = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            if tags.get("run_id") == run_id:
                keys = ("role",) if m.group(1).startswith("role_") else ("stage", "direction", "queue", "worker",
                                                                          "layer", "expert")
                extra = tuple(sorted((k, v) for k, v in tags.items() if k in keys))
                found[(m.group(1), extra)] = float(m.group(3))
        if {name for name, _ in found} >= wanted and found.get(("step", ())) == final_step \
                and found.get(("checkpoint_step", ())) == final_step:
            return found
        time.sleep(2)
    return found


def test_gauges_are_exported_on_the_node_metrics_endpoint(finished_run):
    cfg, result, _, found, _ = finished_run
    assert {name for name, _ in found} >= set(GAUGES), sorted(found)
    assert set(GAUGES) | set(MOE_GAUGES) == set(UNITS)  # every gauge has its unit; this test or the MoE one checks it
    missing = grafana_metrics() - set(MOE_GAUGES) - {name for name, _ in found}
    assert not missing, f"the Grafana dashboard reads metrics no run exports: {sorted(missing)}"
    rows = [json.loads(line) for line in open(os.path.join(result.run_dir, "metrics.jsonl"))]
    last = rows[-1]
    assert found[("step", ())] == STEPS
    assert found[("checkpoint_step", ())] == STEPS
    assert found[("loss", ())] == pytest.approx(result.losses[-1], rel=1e-6)
    assert found[("val_loss", ())] == pytest.approx(result.val_losses[3], rel=1e-6)  # the last step's
    assert found[("learning_rate", ())] == pytest.approx(last["lr"], rel=1e-6)
    assert found[("grad_norm", ())] == pytest.approx(last["grad_norm"], rel=1e-6)
    assert found[("tokens_per_s", ())] == pytest.approx(last["tokens"] / last["step_s"], rel=1e-6)
    # both FLOPs conventions, in the row and on the gauges (megatrain_ray.model.flops)
    assert last["tflops_6nt"] == pytest.approx(flops.flops_6nt(cfg.model, last["tokens"]) / last["step_s"] / 1e12)
    assert last["tflops_palm"] == pytest.approx(
        flops.palm_model_flops(cfg.model, cfg.train.seq_len, last["tokens"]) / last["step_s"] / 1e12)
    for key in ("tflops_6nt", "tflops_palm"):
        assert found[(key, ())] == pytest.approx(last[key], rel=1e-6) and last[key] > 0
    spec = StoreSpec(cfg.model, Precision(torch.float32, torch.float32), "/dev/shm", 0, "x")  # cpu: fp32
    assert found[("host_store_bytes", ())] == spec.nbytes()
    assert found[("host_memory_used_bytes", ())] > 0
    for stage in ("h2d", "compute", "d2h", "wait", "device_update", "adamw"):
        busy = found[("stage_busy_s", (("stage", stage),))]
        key = "update_busy_s" if stage == "adamw" else f"{stage}_busy_s"
        assert busy == pytest.approx(last[key], rel=1e-6, abs=1e-12)
        assert found[("stage_busy_fraction", (("stage", stage),))] == pytest.approx(busy / last["step_s"], rel=1e-6)
        if stage not in ("adamw", "device_update"):  # one worker: its own lanes are the step's
            assert found[("worker_busy_fraction", (("stage", stage), ("worker", "0")))] == pytest.approx(
                busy / last["step_s"], rel=1e-6)
    assert found[("stage_busy_s", (("stage", "compute"),))] > 0
    assert found[("link_gbps", (("direction", "h2d"),))] > 0
    assert found[("worker_link_gbps", (("direction", "h2d"), ("worker", "0")))] == found[
        ("link_gbps", (("direction", "h2d"),))]
    assert found[("queue_depth", (("queue", "grad"),))] >= 0
    # What each role was doing last (published by the roles' actors, orchestration.labels): the
    # prefetcher issuing the last step's tickets, the sink applying the last step's updates. An
    # actor's gauges reach the endpoint every 10 s (Ray's metrics_report_interval_ms) and the run
    # removes its actors when it ends, so what the endpoint keeps is a state the role passed through
    # in the 10 s before the end: on a loaded machine any step of the run, any unit of it.
    for role in ("prefetch", "grad-sink"):
        step, unit = found[("role_step", (("role", role),))], found[("role_unit", (("role", role),))]
        assert step in range(1, STEPS + 1), (role, step)
        assert unit in range(cfg.model.num_hidden_layers + 2), (role, unit)
    assert 0 <= found[("queue_depth", (("queue", "fetch"),))] <= 2  # it holds at most buffer_depth (2 on cpu)


def test_moe_gauges_are_exported(ray_cluster, tmp_path, shm_dir):
    """A mixture of experts' run sets aux_loss, expert_tokens{layer, expert} and expert_imbalance{layer}
    to its last step's values (metrics.jsonl), the sparse layers named by their decoder layer index.
    Among the tests of the module's run on purpose: they read what the endpoint showed as that run ended,
    so another run in the same Ray session in between changes nothing they see."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "configs", "tiny-moe.yaml"), [
        f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path / 'runs'}", "compute.device=cpu", "train.steps=2",
        "train.checkpoint_every=2", "train.save_final=false", "cluster.actor_timeout_s=120", "optim.warmup_steps=1"])
    result = train(cfg, log=lambda line: None)
    found = _scrape(result.run_id, 2, wanted=set(MOE_GAUGES))
    last = [json.loads(line) for line in open(os.path.join(result.run_dir, "metrics.jsonl"))][-1]
    assert found[("aux_loss", ())] == pytest.approx(last["aux_loss"], rel=1e-6) and last["aux_loss"] > 0
    for layer, counts in zip(cfg.model.sparse_layers, last["expert_tokens"]):
        assert [found[("expert_tokens", (("expert", str(e)), ("layer", str(layer))))] for e in range(8)] == counts
        assert found[("expert_imbalance", (("layer", str(layer)),))] == pytest.approx(max(counts) / (sum(counts) / 8))


def test_stage_gauges_name_their_role(finished_run):
    """stage_busy_* carry the role each stage belongs to, as the Grafana panel "per role" shows them."""
    _, result, _, _, text = finished_run
    roles = {}
    for m in re.finditer(r'^ray_megatrain_stage_busy_fraction\{([^}]*)\}', text, re.M):
        tags = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if tags.get("run_id") == result.run_id:
            roles[tags["stage"]] = tags["role"]
    assert roles == STAGE_ROLE == {"h2d": "compute", "compute": "compute", "d2h": "compute", "wait": "compute",
                                   "device_update": "compute", "adamw": "grad-sink"}


def test_metrics_file_and_console_line(finished_run):
    _, result, lines, _, _ = finished_run
    rows = [json.loads(line) for line in open(os.path.join(result.run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows] == result.losses
    for r in rows:
        assert r["compute_busy_s"] > 0 and r["update_busy_s"] > 0 and r["tokens_per_s"] > 0
    # The ETA leaves the first step (compile, warm-up) out: none after it, then the mean pace of the
    # recent steps, each the longer of its period and its run time (megatrain_ray.progress.Eta).
    assert rows[0]["eta_s"] is None and rows[-1]["eta_s"] == 0
    paces = [max(rows[j]["elapsed_s"] - rows[j - 1]["elapsed_s"], rows[j]["step_s"]) for j in range(1, STEPS)]
    for k in range(1, STEPS - 1):
        recent = paces[:k][-ETA_STEPS:]
        assert rows[k]["eta_s"] == pytest.approx(sum(recent) / len(recent) * (STEPS - 1 - k), rel=1e-6)
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert len(steps) == STEPS
    assert re.search(r"\| [\d,]+ tok/s \| eta \.\.\.( \| val loss .*)?$", steps[0]), steps[0]
    assert all(re.search(r"\| [\d,]+ tok/s \| eta \d+(s|m\d\ds|h\d\dm)"
                         r"( \| val loss [0-9.]+ \(after (0|2|3) updates\))?$", ln) for ln in steps[1:]), steps
    assert [float(re.search(r"val loss ([0-9.]+)", ln).group(1)) for ln in steps if "val loss" in ln] == [
        round(result.val_losses[s], 4) for s in (0, 2, 3)]  # every 2 steps, and the last
    assert [ln for ln in lines if ln.startswith("checkpoint: step")] == [
        ln for ln in lines if re.match(r"checkpoint: step (2|4) saved to .*step-00000(2|4) in [0-9.]+ s "
                                                          r"\(the sink waited [0-9.]+ s for it\)$", ln)]
    assert len(result.checkpoints) == 2


def test_plot_writes_pngs(finished_run, capsys):
    from PIL import Image

    _, result, _, _, _ = finished_run
    assert cli.main(["plot", result.run_dir]) == 0
    written = capsys.readouterr().out.split()
    names = sorted(os.path.basename(p) for p in written)
    assert names == ["loss.png", "stages.png", "throughput.png", "timeline.png"]
    for path in written:
        assert os.path.dirname(path) == os.path.join(result.run_dir, "plots")
        with Image.open(path) as img:
            assert img.format == "PNG" and img.size[0] >= 600 and img.size[1] >= 250
            lo, hi = img.convert("L").getextrema()
            assert hi - lo > 100  # something was drawn


def test_plots_name_the_cpu_copy_lanes_and_keep_legends_off_the_data(finished_run):
    """The figures behind the PNGs: on a CPU run the copy stages are "copy in"/"copy out" (there is no
    device to go to); throughput has one line read on three labelled axes (tokens/s and the two FLOPs
    conventions); legends sit below the axes."""
    import matplotlib.pyplot as plt

    from megatrain_ray.plot import figures, run_device

    _, result, _, _, _ = finished_run
    assert run_device(result.run_dir) == "cpu"
    figs = figures(result.run_dir)
    try:
        stages = figs["stages.png"].axes[0]
        labels = [t.get_text() for t in stages.get_legend().get_texts()]
        assert labels == ["copy in", "compute", "copy out", "wait", "device_update", "adamw"]
        timeline = figs["timeline.png"].axes[0]
        assert [t.get_text() for t in timeline.get_yticklabels()] == labels

        throughput = figs["throughput.png"].axes[0]
        (line,) = throughput.get_lines()
        assert throughput.get_ylabel() == "tokens/s"
        assert sorted(c.get_ylabel() for c in throughput.child_axes) == [
            "TFLOP/s (6·N·T)", "TFLOP/s (PaLM: matmuls + attention)"]  # one scale per FLOPs convention
        assert [t.get_text() for t in throughput.get_legend().get_texts()] == [line.get_label()]
        assert line.get_label().startswith("tokens/s (left axis) = TFLOP/s (right axes; 6·N·T ")

        loss = figs["loss.png"].axes[0]
        assert [t.get_text() for t in loss.get_legend().get_texts()] == [
            "loss", "validation loss", "learning rate (right axis)"]
        for fig, ax in ((figs["stages.png"], stages), (figs["throughput.png"], throughput), (figs["loss.png"], loss)):
            fig.canvas.draw()
            box, data = ax.get_legend().get_window_extent(), ax.get_window_extent()
            assert box.y1 <= data.y0 and box.y0 >= 0, fig  # under the axes, inside the figure
    finally:
        for fig in figs.values():
            plt.close(fig)


def test_plot_and_dashboard_agree_on_names_units_and_values(finished_run):
    """Each series of ``megatrain-ray plot`` is a gauge that a panel of the Grafana dashboard reads, in
    the same unit, and its last point is the value that gauge exported for the run's last step."""
    import matplotlib.pyplot as plt

    from megatrain_ray.plot import GAUGES as PLOTTED
    from megatrain_ray.plot import figures, stage_labels

    _, result, _, found, _ = finished_run
    with open(grafana.SHIPPED) as f:
        board = json.load(f)
    panel_unit = {m: panel["fieldConfig"]["defaults"]["unit"] for panel in board["panels"]
                  for t in panel["targets"] for m in re.findall(r"ray_megatrain_(\w+)", t["expr"])}
    for series, gauge in PLOTTED.items():
        assert gauge in panel_unit, f"the plot's {series} is on no dashboard panel"
        assert panel_unit[gauge] == grafana.GRAFANA_UNITS[UNITS[gauge]], gauge

    figs = figures(result.run_dir)
    try:
        loss_ax, lr_ax = figs["loss.png"].axes[:2]
        assert loss_ax.get_ylabel() == "loss (nats/token)" and UNITS["loss"] == UNITS["val_loss"] == "nats/token"
        lines = {ln.get_label(): ln for ln in loss_ax.get_lines() + lr_ax.get_lines()}
        assert lines["loss"].get_ydata()[-1] == pytest.approx(found[("loss", ())], rel=1e-6)
        assert lines["validation loss"].get_ydata()[-1] == pytest.approx(found[("val_loss", ())], rel=1e-6)
        assert lines["learning rate (right axis)"].get_ydata()[-1] == pytest.approx(found[("learning_rate", ())],
                                                                                  rel=1e-6)
        throughput = figs["throughput.png"].axes[0]
        assert throughput.get_ylabel() == UNITS["tokens_per_s"] == "tokens/s"
        assert throughput.get_lines()[0].get_ydata()[-1] == pytest.approx(found[("tokens_per_s", ())], rel=1e-6)
        assert {c.get_ylabel().split(" (")[0] for c in throughput.child_axes} == {UNITS["tflops_6nt"]} == {
            UNITS["tflops_palm"]}
        stages = figs["stages.png"].axes[0]
        assert stages.get_ylabel() == f"busy {UNITS['stage_busy_fraction']}"
        by_label = {ln.get_label(): ln for ln in stages.get_lines()}
        for stage, label in stage_labels("cpu").items():  # the gauge's stage tag under the plot's CPU name
            assert by_label[label].get_ydata()[-1] == pytest.approx(
                found[("stage_busy_fraction", (("stage", stage),))], rel=1e-6, abs=1e-12), stage
    finally:
        for fig in figs.values():
            plt.close(fig)


def test_the_shipped_grafana_file_is_what_the_builder_writes():
    """megatrain_ray/dashboards/megatrain.json is rewritten by ``python -m megatrain_ray.orchestration.grafana``;
    every gauge has a panel, every panel one unit."""
    with open(grafana.SHIPPED) as f:
        assert f.read() == grafana.render()
    assert grafana.metric_names() == set(UNITS) == grafana_metrics()


def test_plot_of_a_resumed_run_reads_the_steps_before_it_from_the_run_it_resumed(tmp_path):
    """A resumed run's directory holds the steps it trained; its config.json names the checkpoint it
    began from (resumed_from), whose run holds the steps before: read_metrics joins them (the resumed
    run's rows win from its first step on), following resumed_from back through every resume."""
    from megatrain_ray.plot import read_metrics

    def run(name, steps, resumed_from=None):
        d = tmp_path / name
        (d / "checkpoints").mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 10.0 - s, "run": name}) + "\n"
                                                 for s in steps))
        (d / "config.json").write_text(json.dumps({"resumed_from": resumed_from} if resumed_from else {}))
        return d

    # A row's step counts the updates done (1 after the first), as the checkpoints' names do.
    a = run("a", range(1, 7))                                         # interrupted after step 6
    b = run("b", range(5, 10), str(a / "checkpoints" / "step-000004"))  # resumed from step 4 of a
    c = run("c", range(10, 13), str(b / "checkpoints" / "step-000009"))
    rows = read_metrics(str(c))
    assert [(r["step"], r["run"]) for r in rows] == [*((s, "a") for s in range(1, 5)), *((s, "b") for s in range(5, 10)),
                                                    *((s, "c") for s in range(10, 13))]
    assert [r["step"] for r in read_metrics(str(a))] == list(range(1, 7))
    (a / "metrics.jsonl").unlink()  # the earlier run is gone: the resumed one's rows alone
    assert [r["step"] for r in read_metrics(str(b))] == list(range(5, 10))


def test_a_metrics_file_whose_steps_count_from_0_is_read_as_the_updates_done(tmp_path):
    """metrics.jsonl written when a row's step counted from 0 (step 0: after the first update) is read
    as rows are written now, step 1 after the first update, so old and new runs plot alike."""
    from megatrain_ray.plot import read_metrics

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0 - s}) + "\n" for s in range(3)))
    assert [(r["step"], r["loss"]) for r in read_metrics(str(tmp_path))] == [(1, 9.0), (2, 8.0), (3, 7.0)]


def test_a_profiled_step_leaves_its_trace_and_summary_where_its_row_says(finished_run):
    _, result, lines, _, _ = finished_run
    with open(os.path.join(result.run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    where = os.path.join(result.run_dir, "profile", "step-3")
    assert [r.get("profile") for r in rows] == [None, None, where, None]
    assert any(line.startswith(f"profile: step 3 recorded in {where} ") for line in lines)
    worker = os.path.join(where, "worker-0")
    with gzip.open(os.path.join(worker, "trace.json.gz")) as f:
        ops = {e["name"] for e in json.load(f)["traceEvents"] if e.get("cat") == "cpu_op"}
    assert {"aten::mm", "aten::addmm"} & ops and "aten::scaled_dot_product_attention" in ops  # the step's own work
    with open(os.path.join(worker, "kernels.txt")) as f:
        text = f.read()
    assert text.startswith("No device kernels in this step") and "Operators (torch.profiler):" in text
    assert "aten::" in text.split("Operators (torch.profiler):")[1]
