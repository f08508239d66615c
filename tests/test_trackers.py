"""Experiment trackers (train.loggers): one real run logs to TensorBoard, MLflow and W&B (offline)
with the real libraries, and each is read back with its own reader: TensorBoard's event
accumulator, MLflow's client on the run's store, and the records of W&B's offline run file. Every
tracker holds each step's loss as metrics.jsonl has it, at the step's number, under the Ray
gauges' names."""

import json
import os
import struct
import sys

import pytest

from megatrain_ray.config import load_config
from megatrain_ray.errors import ConfigError
from megatrain_ray.orchestration import trackers
from megatrain_ray.orchestration.gauges import UNITS
from megatrain_ray.orchestration.pipeline import train

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")
pytest.importorskip("wandb")


def _wandb_records(path: str) -> list:
    """The protobuf records of a W&B run file (``run-<id>.wandb``): a 7-byte header (``:W&B``, key
    0xBEE1, version 0), then LevelDB-log blocks of 32 KiB whose records (4-byte checksum, 2-byte
    length, 1-byte type: full, first, middle, last) carry one serialized ``Record`` each."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0)
    records, pos, parts, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room left in the block for a header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


@pytest.fixture(scope="module")
def tracked_run(ray_cluster, shm_dirs, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tracked")
    with shm_dirs() as shm_dir:
        cfg = load_config(None, [f"memory.shm_dir={shm_dir}", f"train.run_dir={run_dir}", "train.steps=3",
                                 "compute.device=cpu", "train.save_final=false",
                                 "train.loggers=[tensorboard, mlflow, wandb]"])
        lines = []
        result = train(cfg, log=lines.append)
    rows = [json.loads(line) for line in open(os.path.join(result.run_dir, "metrics.jsonl"))]
    return result, rows, lines


def _names_are_gauges(names) -> None:
    for name in names:
        assert name.split("/")[0] in UNITS, name


def test_tensorboard_event_files_hold_every_step(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result, rows, _ = tracked_run
    events = EventAccumulator(os.path.join(result.run_dir, "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    _names_are_gauges(scalars)
    assert {"loss", "learning_rate", "grad_norm", "tokens_per_s", "stage_busy_s/adamw", "step_time_s"} <= set(scalars)
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [r["step"] for r in rows] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)  # float32 in the file
    assert [e.value for e in events.Scalars("learning_rate")] == pytest.approx([r["lr"] for r in rows], rel=1e-6)


def test_mlflow_store_holds_the_run_its_params_and_every_step(tracked_run):
    from mlflow.tracking import MlflowClient

    result, rows, _ = tracked_run
    client = MlflowClient(tracking_uri=f"sqlite:///{result.run_dir}/mlflow.db")
    experiment = client.get_experiment_by_name(trackers.EXPERIMENT)
    (run,) = client.search_runs([experiment.experiment_id], filter_string=f"tags.megatrain_run_id = '{result.run_id}'")
    assert run.info.status == "FINISHED" and run.info.run_name == result.run_id
    assert run.data.params["train.steps"] == "3" and run.data.params["train.loggers"] == json.dumps(
        ["tensorboard", "mlflow", "wandb"])
    _names_are_gauges(run.data.metrics)
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["loss"]) for r in rows]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "grad_norm")] == [r["grad_norm"] for r in rows]


def test_wandb_offline_run_holds_the_config_and_every_step(tracked_run):
    result, rows, lines = tracked_run
    (offline,) = [d for d in os.listdir(os.path.join(result.run_dir, "wandb")) if d.startswith("offline-run-")]
    path = os.path.join(result.run_dir, "wandb", offline, f"run-{result.run_id}.wandb")
    records = _wandb_records(path)
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    steps = [h for h in history if "loss" in h]
    assert [h["_step"] for h in steps] == [1, 2, 3]
    assert [h["loss"] for h in steps] == [r["loss"] for r in rows]
    _names_are_gauges(k for h in history for k in h if not k.startswith("_"))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.run_id == result.run_id and run.display_name == result.run_id
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["train"]["steps"] == 3 and config["train"]["loggers"] == ["tensorboard", "mlflow", "wandb"]
    assert not any("wandb" in line and "warning" in line for line in lines), lines


def test_a_missing_tracker_library_is_one_sentence_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as import sees a package that is not installed
    with pytest.raises(ConfigError) as info:
        trackers.check(["tensorboard", "mlflow"])
    assert str(info.value) == ("train.loggers asks for mlflow, whose library is not installed; pip install mlflow "
                               "(or 'megatrain-ray[trackers]'), or remove it from train.loggers.")


def test_loggers_are_validated_by_name():
    assert load_config(None, ["train.loggers=tensorboard,wandb"]).train.loggers == ("tensorboard", "wandb")
    assert load_config(None, ["train.loggers=[mlflow]"]).train.loggers == ("mlflow",)
    with pytest.raises(ConfigError, match=r"train.loggers must be a list of distinct names of tensorboard, mlflow, "
                                          r"wandb \(e.g. \[tensorboard, mlflow\]\), got \['neptune'\]"):
        load_config(None, ["train.loggers=[neptune]"])


def test_a_tracker_that_cannot_start_is_dropped_with_one_line(tmp_path, read_only_dir):
    """A tensorboard folder that cannot be written, a damaged mlflow.db: each tracker is dropped in one
    warning line naming it and why, and the run goes on (logging to it is then nothing)."""
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / "mlflow.db").write_bytes(b"this is not an SQLite database" * 100)
    lines = []
    for name, run_dir in (("tensorboard", read_only_dir), ("mlflow", tmp_path / "damaged")):
        tracked = trackers.Trackers([name], str(run_dir), "r1", {"train": {"steps": 1}}, lines.append)
        assert tracked.active == {}
        tracked.log({"loss": 1.0}, 1)
        tracked.close("FINISHED")
    assert len(lines) == 2 and all("\n" not in line for line in lines), lines
    assert lines[0].startswith("warning: the tensorboard tracker could not start (") and "Read-only" in lines[0], lines
    assert lines[1].startswith("warning: the mlflow tracker could not start (") and "not a database" in lines[1], lines
    assert all(line.endswith("; the run goes on without it") for line in lines)


@pytest.fixture
def wandb_unreachable(monkeypatch):
    """W&B online (an API key given) at a server that is not there, with a 5 s bound on its start: as
    on a machine without a network. W&B reads its settings from the environment once a process, so
    its state is torn down around the test, as a fresh process would have it."""
    import wandb

    for key, value in {"WANDB_MODE": "online", "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": "0" * 40,
                       "WANDB_INIT_TIMEOUT": "5"}.items():
        monkeypatch.setenv(key, value)
    wandb.teardown()
    yield
    wandb.teardown()


def test_wandb_online_without_a_network_is_dropped_with_one_line(tmp_path, wandb_unreachable, capfd):
    import time

    lines = []
    started = time.monotonic()
    tracked = trackers.Trackers(["wandb"], str(tmp_path), "r1", {"train": {"steps": 1}}, lines.append)
    assert tracked.active == {} and time.monotonic() - started < 60  # its own bound, not W&B's 90 s default
    tracked.log({"loss": 1.0}, 1)
    tracked.close("FINISHED")
    (line,) = lines
    assert line.startswith("warning: the wandb tracker could not start (CommError: ") and "\n" not in line, line
    assert line.endswith("; the run goes on without it"), line
    out, err = capfd.readouterr()  # nothing of W&B's own on the terminal (not its login line either)
    assert out == "" and err == "", (out, err)


def test_a_run_whose_tracker_cannot_start_trains_on_and_writes_every_row(ray_cluster, shm_dir, tmp_path,
                                                                         wandb_unreachable):
    """A whole run with train.loggers [tensorboard, wandb] and W&B unreachable: one warning line for
    W&B, every step trained, each one's row in metrics.jsonl, and TensorBoard given every step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(None, [f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path}", "train.steps=3",
                             "compute.device=cpu", "train.save_final=false", "train.loggers=[tensorboard, wandb]"])
    lines = []
    result = train(cfg, log=lines.append)
    (warning,) = [line for line in lines if line.startswith("warning:")]
    assert warning.startswith("warning: the wandb tracker could not start (CommError: "), warning
    rows = [json.loads(line) for line in open(os.path.join(result.run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["loss"] for r in rows] == result.losses
    assert warning in open(os.path.join(result.run_dir, "train.log")).read()
    events = EventAccumulator(os.path.join(result.run_dir, "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]
