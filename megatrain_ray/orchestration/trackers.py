"""Experiment trackers (``train.loggers``): every step's metrics, as the Ray gauges name them, to
TensorBoard, MLflow and Weights & Biases, in the run's directory.

Each tracker gets what :class:`~megatrain_ray.orchestration.metrics.RunMetrics` sets on its gauges,
one scalar per gauge and tag (``loss``, ``tokens_per_s``, ``stage_busy_s/h2d``, ``queue_depth/grad``
...: the gauge's name, then its tags' values; see :func:`RunMetrics.scalars`), at the step's number
(steps finished: 1 after the first update, as the log line counts), and the run's config once:

- ``tensorboard``: event files in ``runs/<id>/tensorboard`` (``tensorboard --logdir runs``);
- ``mlflow``: a local MLflow store, ``runs/<id>/mlflow.db`` (SQLite; MLflow's plain-file store is
  in maintenance mode and refused by default) with artifacts under ``runs/<id>/mlartifacts``;
  experiment ``megatrain_ray``, one MLflow run per run id, continued by a resumed run; browse it with
  ``mlflow ui --backend-store-uri sqlite:///runs/<id>/mlflow.db``;
- ``wandb``: offline (no network, no account) unless ``WANDB_MODE`` says otherwise, in
  ``runs/<id>/wandb``; ``wandb sync runs/<id>/wandb/offline-run-*`` uploads it later. W&B prints
  nothing on the terminal (not its login line either); its own logs are in that folder.

The libraries are optional (``pip install 'megatrain-ray[trackers]'``); one asked for but missing
is a ConfigError before the run starts (:func:`check`). A tracker that fails to start (W&B online
without a network, a damaged mlflow.db, a tensorboard folder it cannot write) or fails during the
run is dropped with one warning line naming it and why: it never stops the training, and
metrics.jsonl holds every step whatever the trackers do.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time

from ..config.sections import LOGGERS
from ..errors import ConfigError

TRACKERS = dict(zip(LOGGERS, ("tensorboard", "mlflow", "wandb")))
"""train.loggers' names -> the module (and pip package) each needs."""

EXPERIMENT = "megatrain_ray"
"""The MLflow experiment and W&B project runs are logged to."""


def check(names: list[str]) -> None:
    """One ConfigError naming the pip install if a tracker's library is missing."""
    for name in names:
        module = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"train.loggers asks for {name}, whose library is not installed; "
                              f"pip install {module} (or 'megatrain-ray[trackers]'), or remove it from train.loggers.")


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """{"model.hidden_size": "256", ...}: a nested config as flat string parameters."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)
    return out


class _TensorBoard:
    def __init__(self, run_dir: str, run_id: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))
        self.writer.add_text("config", f"```\n{json.dumps(config, indent=2)}\n```")

    def log(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self, status: str) -> None:
        self.writer.close()


class _MLflow:
    def __init__(self, run_dir: str, run_id: str, config: dict):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=f"sqlite:///{os.path.abspath(run_dir)}/mlflow.db")
        experiment = self.client.get_experiment_by_name(EXPERIMENT)
        experiment_id = (experiment.experiment_id if experiment is not None else self.client.create_experiment(
            EXPERIMENT, artifact_location=f"file://{os.path.abspath(run_dir)}/mlartifacts"))
        earlier = self.client.search_runs([experiment_id], filter_string=f"tags.megatrain_run_id = '{run_id}'")
        if earlier:  # a resumed run continues its MLflow run
            self.run_id = earlier[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_id,
                                                 tags={"megatrain_run_id": run_id}).info.run_id
            from mlflow.entities import Param

            params = [Param(k, v[:6000]) for k, v in flat_params(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch (experts: many)
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)


class _WandB:
    def __init__(self, run_dir: str, run_id: str, config: dict):
        import wandb

        quiet = wandb.Settings(console="off", silent=True, x_disable_stats=True)
        wandb.setup(settings=quiet)  # silent from the start: its login line too (what fails is our warning)
        self.run = wandb.init(project=EXPERIMENT, name=run_id, id=run_id, resume="allow", config=config,
                              dir=run_dir, mode=os.environ.get("WANDB_MODE", "offline"), settings=quiet)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


_KINDS = {"tensorboard": _TensorBoard, "mlflow": _MLflow, "wandb": _WandB}


class Trackers:
    """The trackers of ``names`` for one run (see the module docstring); ``warn``: the run's log."""

    def __init__(self, names: list[str], run_dir: str, run_id: str, config: dict, warn=print):
        self.warn = warn
        self.active: dict[str, object] = {}
        check(names)
        for name in names:
            try:
                self.active[name] = _KINDS[name](run_dir, run_id, config)
            except Exception as e:  # noqa: BLE001 (a tracker never stops the training)
                self.warn(f"warning: the {name} tracker could not start ({_why(e)}); the run goes on without it")

    def log(self, values: dict[str, float], step: int) -> None:
        """One step's scalars to every tracker; a tracker that fails is dropped, with a warning."""
        for name, tracker in list(self.active.items()):
            try:
                tracker.log(values, step)
            except Exception as e:  # noqa: BLE001 (a tracker never stops the training)
                del self.active[name]
                self.warn(f"warning: the {name} tracker failed ({_why(e)}); the run goes on without it")

    def close(self, status: str = "FINISHED") -> None:
        """End every tracker's run: FINISHED, KILLED (interrupted) or FAILED."""
        for name, tracker in self.active.items():
            try:
                tracker.close(status)
            except Exception as e:  # noqa: BLE001
                self.warn(f"warning: the {name} tracker did not close cleanly ({_why(e)})")
        self.active = {}


def _why(e: BaseException) -> str:
    """A library's error in one line: its type and the first line of its message (SQLAlchemy's and
    W&B's run on with the statement, a link and a traceback of their own)."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__
