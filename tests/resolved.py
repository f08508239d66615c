"""Roles' settings for tests that build a role directly: always through
:func:`~megatrain_ray.orchestration.resolve.resolve`, as the drivers build them, so a test's role
holds the settings (policies, update order, threads) a run of its config would."""

from __future__ import annotations

import dataclasses

from megatrain_ray.config import TrainConfig
from megatrain_ray.engine.settings import SinkSettings
from megatrain_ray.orchestration.preflight import MemoryPlan
from megatrain_ray.orchestration.resolve import Facts, ResolvedRun, resolve


def resolved(cfg: TrainConfig, device: str = "cpu") -> ResolvedRun:
    """The run of ``cfg`` on ``device`` (this machine's facts otherwise)."""
    return resolve(cfg, Facts(device))


def planned(cfg: TrainConfig, device: str = "cpu", device_bytes: int | None = None, starts_ray: bool = False,
            host_bytes: int | None = None) -> MemoryPlan:
    """The memory plan of ``cfg`` as a run on ``device`` with these facts resolves it (the plan counts
    what :func:`resolve` decided; it decides nothing itself)."""
    return resolve(cfg, Facts(device, device_bytes, starts_ray, host_bytes=host_bytes)).memory


def sink_settings(cfg: TrainConfig, device: str = "cpu", **changes) -> SinkSettings:
    """The gradient sink's settings of ``cfg``, with ``changes`` to what does not decide a unit's
    policy (timeout_s, optimizer_threads)."""
    return dataclasses.replace(resolved(cfg, device).sink, **changes)
