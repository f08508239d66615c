"""Keys of the former ``runtime`` section: each one a user still writes (in a YAML file or with
``--set runtime.X=...``) is refused at load with one sentence naming its new place (or saying it is
gone and why), before anything starts; a run config the program saved with them (a checkpoint's
meta.json, a run's config.json) is upgraded to today's sections with the same meaning.
"""

import dataclasses

import pytest

from megatrain_ray import cli
from megatrain_ray.config import load_config
from megatrain_ray.config.moved import MOVED, REWRITTEN, upgrade_saved
from megatrain_ray.errors import ConfigError


def _error(path=None, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return str(info.value)


@pytest.mark.parametrize("old,new", sorted(MOVED.items()))
def test_a_moved_key_through_set_names_its_new_place(old, new):
    assert _error(overrides=[f"runtime.{old}=1"]) == (
        f"runtime.{old} is now {new}; write it there (under {new.split('.')[0]}: in the file, or --set {new}=...).")


def test_every_key_named_as_a_new_place_exists():
    cfg = load_config(None, [])
    for new in MOVED.values():
        section, key = new.split(".")
        assert key in {f.name for f in dataclasses.fields(getattr(cfg, section))}, new


def test_a_moved_key_in_a_yaml_file_names_its_new_place(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("train:\n  steps: 3\nruntime:\n  device: cpu\n  run_dir: runs\n")
    assert _error(str(path)) == ("runtime.device is now compute.device; write it there (under compute: in the "
                                 "file, or --set compute.device=...).")


@pytest.mark.parametrize("old,says", [
    ("split_update=false", "runtime.split_update is gone: the two-pass update is bit for bit the one-pass update, so "
                           "every run it applies to uses it."),
    ("offload_activations=true", "runtime.offload_activations is gone: write memory.activations: offload, which "
                                 "says the same."),
    ("activations=keep=2,host=1", "runtime.activations is now memory.activations (auto, recompute, offload, keep, or "
                                  "counts with the counts of \"keep=K,host=H,span=P\" as memory.kept_layers, "
                                  "memory.offloaded_layers and memory.spanned_layers)."),
    ("device_adamw=edges+1", "runtime.device_adamw is now memory.resident (auto, none, or embed_head for the former "
                             "edges; edges+K is embed_head with memory.resident_layers: K)."),
])
def test_a_removed_or_reshaped_key_gets_its_sentence(old, says):
    assert _error(overrides=[f"runtime.{old}"]) == says
    assert set(REWRITTEN) == {"split_update", "offload_activations", "activations", "device_adamw"}


def test_an_unknown_or_empty_runtime_section_names_the_sections_of_today(tmp_path):
    known = "runtime's keys moved to the sections precision, compute, memory, parallel, cluster, experimental and train"
    assert _error(overrides=["runtime.speed=1"]) == f"runtime.speed is not a known key; {known} (see docs/configuration.md)."
    path = tmp_path / "empty.yaml"
    path.write_text("runtime: {}\n")
    assert _error(str(path)) == f"runtime is no longer a section; {known} (see docs/configuration.md)."


def test_the_cli_refuses_an_old_key_before_anything_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--set", "runtime.compute_workers=2"]) == 2
    err = capsys.readouterr().err
    assert "error: runtime.compute_workers is now parallel.compute_workers" in err
    assert list(tmp_path.iterdir()) == []  # no run directory, no Ray


def test_a_saved_config_with_the_runtime_section_is_upgraded_to_the_same_run(tmp_path):
    old = {"model": {"num_hidden_layers": 4}, "train": {"steps": 3},
           "runtime": {"device": "cpu", "master_dtype": "bfloat16", "compute_workers": 1, "hold_grads": False,
                       "activations": "keep=1,host=2", "device_adamw": "none", "split_update": True,
                       "offload_activations": False, "run_dir": str(tmp_path), "loggers": ["tensorboard"],
                       "actor_timeout_s": 60.0}}
    cfg = load_config(None, [], base=old)
    same = load_config(None, ["model.num_hidden_layers=4", "train.steps=3", "compute.device=cpu",
                              "precision.master_dtype=bfloat16", "experimental.hold_grads=false",
                              "memory.activations=counts", "memory.kept_layers=1", "memory.offloaded_layers=2",
                              "memory.resident=none", f"train.run_dir={tmp_path}", "train.loggers=[tensorboard]",
                              "cluster.actor_timeout_s=60"])
    assert cfg == same
    assert upgrade_saved({"runtime": {"device_adamw": "edges+2"}})["memory"] == {"resident": "embed_head",
                                                                                 "resident_layers": 2}
    assert upgrade_saved({"runtime": {"device_adamw": "edges"}})["memory"] == {"resident": "embed_head",
                                                                               "resident_layers": 0}
    assert upgrade_saved({"runtime": {"offload_activations": True, "activations": "auto"}})["memory"] == {
        "activations": "offload"}
    new = {"model": {}, "train": {"steps": 2}}
    assert upgrade_saved(new) is new  # today's layout is left as it is
