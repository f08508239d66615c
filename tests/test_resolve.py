"""The resolved run: computed once from the config and the machine's facts, printed by ``plan``
exactly, and what every spawned role holds; the config is never rewritten."""

import os
import shutil
import uuid

from megatrain_ray import cli
from megatrain_ray.config import load_config
from megatrain_ray.engine.compute.activations import GPU, KEEP
from megatrain_ray.orchestration import preflight
from megatrain_ray.orchestration.cluster import cluster_to_join
from megatrain_ray.orchestration.resolve import Facts, resolve
from megatrain_ray.orchestration.roles import LocalSpawner, spawn_roles

SMALL = ["model.hidden_size=64", "model.intermediate_size=176", "model.num_hidden_layers=3",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=512"]


def test_plan_prints_the_resolved_run(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # The machine's free memory, fixed: other processes change it between the two resolutions.
    monkeypatch.setattr(preflight, "host_available", lambda: 16 * 2**30)
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**40, 0, 2**39))
    overrides = [*SMALL, "compute.device=cpu"]
    assert cli.main(["plan", *sum((["--set", o] for o in overrides), [])]) == 0
    printed = capsys.readouterr().out
    cfg = load_config(None, overrides)
    run = resolve(cfg, Facts.here(cfg, starts_ray=cluster_to_join(cfg.cluster)[0] is None))
    assert printed.rstrip("\n") == run.describe()
    assert "resident on the device: none (memory.resident=auto: none)" in printed


def test_the_spawned_roles_hold_what_the_run_resolved(shm_dir, tmp_path):
    cfg = load_config(None, [*SMALL, "compute.device=cpu", f"memory.shm_dir={shm_dir}",
                             f"train.run_dir={tmp_path}", "memory.activations=counts", "memory.kept_layers=1", "memory.offloaded_layers=1",
                             "memory.resident=embed_head", "train.steps=2"])
    run = resolve(cfg, Facts.here(cfg))
    assert run.config is cfg and cfg.memory.resident == "embed_head"
    assert run.schedule.resident == (0, 4) and run.schedule.fetch == (1, 2, 3, 3, 2, 1)
    spec = run.store_spec(os.getpid(), "resolve-" + uuid.uuid4().hex[:6])
    roles = spawn_roles(run, [spec], LocalSpawner()).head
    try:
        compute, prefetcher, sink = roles.computes[0], roles.prefetchers[0], roles.sink
        assert compute.settings == run.compute and sink.settings == run.sink
        assert compute.activations.modes == run.compute.activations == ("host", GPU, KEEP)
        assert [type(p).__name__ for p in compute.passes] == ["Recomputed", "Recomputed", "Kept"]
        assert compute.store.spec == sink.store.spec == prefetcher.store.spec == spec
        assert spec.resident == run.schedule.resident and compute.resident.units == run.schedule.resident
        assert tuple(prefetcher.order) == run.schedule.fetch and tuple(sink.order) == run.schedule.sink_updates
        assert sink.runner.threads == run.sink.optimizer_threads == cfg.parallel.resolved_optimizer_threads()
        assert sink.policies == compute.settings.policies == run.policies
        assert [str(p) for p in run.policies] == [
            "weights resident, gradient device, optimizer device", *["weights streamed, gradient host, optimizer "
                                                                     "exact"] * 3,
            "weights resident, gradient device, optimizer device"]  # fp32 compute on the CPU: no stream copy to split to
        assert sorted(sink.optimizers) == [1, 2, 3]
    finally:
        for handle in (compute, sink):
            handle.close()
        roles.store.close()


def test_auto_settings_resolve_from_the_facts_and_the_plan_counts_them():
    cfg = load_config(None, ["model.hidden_size=1024", "model.num_hidden_layers=8", "model.intermediate_size=2816",
                             "model.num_attention_heads=8", "model.vocab_size=32000", "train.seq_len=2048"])
    runs = [resolve(cfg, Facts("cuda", gib * 2**30, adamw_cpus=12)) for gib in (80, 8, 3)]
    assert [r.resident_layers for r in runs] == [1, 1, None]  # as much as fits, by the GPU's memory
    assert [r.compute.activations.count(KEEP) for r in runs] == [8, 5, 0]
    assert [r.schedule.resident for r in runs] == [(0, 1, 9), (0, 1, 9), ()]
    assert {str(p) for p in runs[0].policies[2:-1]} == {"weights streamed, gradient host, optimizer split"}
    for run in runs:  # the plan's activation rows are the placement the compute worker gets
        kept = [r for r in run.memory.rows if "kept whole" in r.component]
        n_kept = run.compute.activations.count(KEEP)
        assert (kept[0].component.startswith(f"activations kept whole ({n_kept} layers") if n_kept else not kept)
    assert resolve(cfg, Facts("cpu")).resident_layers is None and cfg.memory.resident == "auto"


def test_adamw_threads_are_the_cpus_the_pinning_leaves_it():
    """With parallel.optimizer_threads 0 and experimental.cpu_affinity on a GPU, the sink runs one AdamW
    thread per CPU it is pinned to: the plan counts those (Facts.adamw_cpus), and its update time with them."""
    sets = ["compute.device=cuda", "model.hidden_size=256", "model.num_hidden_layers=4"]
    facts = dict(device_bytes=80 * 2**30, host_bytes=2**40, device_tflops=989.0)
    pinned = resolve(load_config(None, sets), Facts("cuda", adamw_cpus=12, **facts))
    assert pinned.sink.optimizer_threads == 12 and pinned.updates.host_threads == 12
    assert "AdamW on 12 CPU threads" in pinned.describe()
    unknown = resolve(load_config(None, sets), Facts("cuda", **facts))
    assert unknown.sink.optimizer_threads == load_config(None, sets).parallel.resolved_optimizer_threads()
    for extra in ("parallel.optimizer_threads=5", "experimental.cpu_affinity=false"):
        run = resolve(load_config(None, [*sets, extra]), Facts("cuda", adamw_cpus=12, **facts))
        assert run.sink.optimizer_threads == load_config(None, [*sets, extra]).parallel.resolved_optimizer_threads()
