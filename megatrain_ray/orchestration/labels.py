"""What the Ray dashboard says about each role: its actor's label and its tasks' names.

Ray shows an actor's ``__repr__`` (the state API's ``repr_name``, the prefix of its log lines) as
it was when the constructor returned: it is never asked again, so it cannot follow the step.
:func:`labelled` gives each role's class, at spawn, a ``__repr__`` that says which role it is and
where it runs (``compute-1: ComputeWorker, node 0, GPU 1``), and a ``health_ping`` method that
records no task event (the health checks call it twice a second); the engine's classes stay
as they are. What a role is doing goes in the names of the tasks the driver submits to it
(:func:`step_task`, :func:`loop_task`), which the dashboard lists per actor with their state
(running, finished, failed): ``ComputeWorker step 12/100``, ``GradientSink grad-sink loop, steps 1-100``.
Inside their loops, the roles that keep a ``doing`` attribute (the prefetcher: the ticket it issues;
the sink: the update it applies, as (step, unit)) have it published by a thread of their actor,
twice a second, as the gauges ``ray_megatrain_role_step`` and ``ray_megatrain_role_unit`` (tags
run_id and role): the Grafana dashboard's "What each role is doing" panels.
"""

from __future__ import annotations

import re
import threading
import time

PUBLISH_EVERY_S = 0.5
"""How often an actor's publisher thread looks at its role's ``doing`` (a tuple read: no cost to the loop)."""


def labelled(cls: type, name: str, node: int, run_id: str) -> type:
    """``cls`` with a ``__repr__`` naming the role ``name`` on node ``node``, and its GPU where Ray
    gave it one (a subclass of the same name, so the dashboard's class column is
    unchanged)."""

    def __repr__(self) -> str:
        import ray

        gpus = ray.get_gpu_ids() if ray.is_initialized() else []
        gpu = f", GPU {','.join(str(g) for g in gpus)}" if gpus else ""
        return f"{name}: {cls.__name__}, node {node}{gpu}"  # the run id is in the actor's name

    def health_ping(self) -> bool:
        """What :mod:`megatrain_ray.orchestration.health` calls twice a second on an idle role."""
        return True

    import ray

    body = {"__repr__": __repr__, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
            # no task events: the pings would fill the role's task list in the dashboard, hiding its real tasks
            "health_ping": ray.method(enable_task_events=False)(health_ping)}
    if hasattr(cls, "doing"):
        base_run = re.sub(r"-r\d+$", "", run_id)  # after a restart, the run's gauges keep its id

        def __init__(self, *args, **kwargs):
            cls.__init__(self, *args, **kwargs)
            threading.Thread(target=_publish, args=(self, {"run_id": base_run, "role": name}), daemon=True,
                             name="megatrain-activity").start()

        body["__init__"] = __init__
    return type(cls.__name__, (cls,), body)


def _publish(role, tags: dict[str, str]) -> None:
    """Set the role's activity gauges whenever its ``doing`` changes (runs for the actor's life)."""
    from ray.util.metrics import Gauge

    step = Gauge("megatrain_role_step", description="Step (1-based) a role of the pipeline is working on.",
                 tag_keys=("run_id", "role"))
    unit = Gauge("megatrain_role_unit", description="Unit (index in the model layout: 0 the embedding, then the "
                 "decoder layers, then the head) a role of the pipeline is working on.", tag_keys=("run_id", "role"))
    last = None
    while True:
        doing = role.doing
        if doing is not None and doing != last:
            step.set(doing[0] + 1, tags=tags)
            unit.set(doing[1], tags=tags)
            last = doing
        time.sleep(PUBLISH_EVERY_S)


def step_task(step: int, steps: int) -> str:
    """The name of a compute worker's task for ``step`` (0-based) of ``steps``: ``ComputeWorker step 12/100``.
    Ray also titles the actor's process with it while it runs (``ray::ComputeWorker step 12/100`` in
    ``ps``), so it starts with the class, as Ray's own titles do."""
    return f"ComputeWorker step {step + 1}/{steps}"


def loop_task(role: str, cls: str, start: int, steps: int) -> str:
    """The name of role ``role`` (of class ``cls``)'s loop over steps [start, steps):
    ``Prefetcher prefetch-0 loop, steps 1-100`` (the process title too, see :func:`step_task`)."""
    return f"{cls} {role} loop, steps {start + 1}-{steps}"
