"""What the Ray dashboard says about each role: its actor's label and its tasks' names.

Ray shows an actor's ``__repr__`` (the state API's ``repr_name``, the prefix of its log lines) as
it was when the constructor returned: it is never asked again, so it cannot follow the step.
:func:`labelled` gives each role's class, at spawn, a ``__repr__`` that says which role it is and
where it runs (``compute-1@0: ComputeWorker, node 0, GPU 1, run <id>``); the engine's classes stay
as they are. What a role is doing goes in the names of the tasks the driver submits to it
(:func:`step_task`, :func:`loop_task`), which the dashboard lists per actor with their state
(running, finished, failed): ``step 12/100`` on a compute worker, ``grad-sink loop, steps 1-100``.
"""

from __future__ import annotations


def labelled(cls: type, name: str, node: int, run_id: str) -> type:
    """``cls`` with a ``__repr__`` naming the role ``name`` on node ``node`` of run ``run_id``, and
    its GPU where Ray gave it one (a subclass of the same name, so the dashboard's class column is
    unchanged)."""

    def __repr__(self) -> str:
        import ray

        gpus = ray.get_gpu_ids() if ray.is_initialized() else []
        gpu = f", GPU {','.join(str(g) for g in gpus)}" if gpus else ""
        return f"{name}: {cls.__name__}, node {node}{gpu}, run {run_id}"

    return type(cls.__name__, (cls,), {"__repr__": __repr__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})


def step_task(step: int, steps: int) -> str:
    """The name of a compute worker's task for ``step`` (0-based) of ``steps``: ``step 12/100``."""
    return f"step {step + 1}/{steps}"


def loop_task(role: str, start: int, steps: int) -> str:
    """The name of a role's loop over steps [start, steps): ``prefetch loop, steps 1-100``."""
    return f"{role} loop, steps {start + 1}-{steps}"
