"""Which Ray a run uses, how it connects (quietly), and where a Ray job writes its outputs.

``cluster.ray_address`` chooses the cluster (:func:`cluster_to_join`):

- ``null`` (default): under ``ray job submit``, the job's cluster (``RAY_ADDRESS``); else the cluster
  that ``ray start --head`` left running on this machine, found the way ``ray.init()`` finds it (the
  address in ``<Ray temp dir>/ray_current_cluster``, if a raylet of that cluster is alive), with one
  line saying so; else a private Ray started for this run, with ``cluster.object_store_memory``.
- ``local``: always a private Ray for this run.
- ``auto``: Ray's own ``auto``: the running cluster of this machine, an error if there is none.
- ``host:port`` or ``ray://host:port``: that cluster.

Token authentication (on by default in Ray 2.60) is left as Ray sets it: a private Ray enables it
and keeps its token in ``~/.ray/auth_token``; joining a cluster found on this machine uses that
token when it exists, as ``ray.init()`` does; an explicit address needs ``RAY_AUTH_MODE=token`` in
the environment (a failure to authenticate says so in one sentence).

A private Ray starts its dashboard on 127.0.0.1 (``cluster.dashboard``, on by default); one line
at start says where it is and where the node's metrics endpoint is (:func:`endpoints_line`), so the
pipeline's gauges can be scraped and its roles seen from the first run.

A private Ray's processes (GCS, raylet, workers, dashboard) run in a session of their own
(:func:`ray_in_own_session`): a signal sent to the driver's whole process group (GNU ``timeout``,
Slurm, systemd) reaches the driver alone, which then still has its actors to save a checkpoint with.
They stay tied to the driver's life (Ray's kernel fate-sharing kills them when it exits).

Ray's own lines that the user cannot act on go to the run's log file only
(:func:`megatrain_ray.orchestration.console.quiet`); its other warnings and errors still show, and
the Grafana provisioning path is written there too.

A Ray job runs its entry point in a temporary copy of the uploaded working directory, deleted with
the session. So in a job, relative output paths (``train.run_dir``, the bench's ``--out``) are
taken from ``~/megatrain-ray`` on the node that runs the job's driver (:func:`job_path`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys

from ..errors import ConfigError, PipelineError
from ..progress import still
from . import console, grafana

DASHBOARD_HOST = "127.0.0.1"
"""Where a private Ray's dashboard listens: this machine only (reach it from elsewhere through an SSH
tunnel, or start a cluster yourself with ``ray start --head --dashboard-host=...``)."""

TOKEN_FILE = "~/.ray/auth_token"
"""Where Ray keeps the token that a private Ray's dashboard asks for (token authentication is on by
default in Ray 2.60)."""

JOB_OUTPUT_ROOT = "~/megatrain-ray"
"""Where a Ray job's relative output paths are taken from (see :func:`job_path`)."""

def running_local_cluster() -> str | None:
    """The GCS address of the cluster ``ray start --head`` runs on this machine, or None.

    Found as ``ray.init()`` finds it: the address Ray recorded in its temp dir
    (``$RAY_TMPDIR/ray``, default ``/tmp/ray``), if a live raylet still serves it; a file left by a
    cluster that crashed does not count.
    """
    from ray._private import services

    address = services.find_bootstrap_address(None)
    if not address:
        return None
    services.find_gcs_addresses.cache_clear()
    return address if address in services.find_gcs_addresses() else None


def cluster_to_join(cluster) -> tuple[str | None, bool]:
    """(address, found): the cluster the run joins (None: it starts a private Ray) and whether that
    address was found running on this machine rather than given (see the module docstring)."""
    if cluster.ray_address == "local":
        return None, False
    if cluster.ray_address:
        return cluster.ray_address, False
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], False
    found = running_local_cluster()
    return found, found is not None


def starts_ray(cluster) -> bool:
    """Whether connecting will start a private Ray (and so its object store) in this process."""
    import ray

    return not ray.is_initialized() and cluster_to_join(cluster)[0] is None


def node_cpus(cluster) -> float | None:
    """CPUs of the largest node of the Ray a run uses: the cluster this process is connected to, or
    the private Ray it will start (as many as Ray detects here); None for a cluster not joined yet."""
    import ray

    if ray.is_initialized():
        return max((n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")), default=0.0)
    if cluster_to_join(cluster)[0] is None:
        from ray._private.utils import get_num_cpus

        return float(get_num_cpus())
    return None


def check_num_workers(cfg) -> None:
    """One ConfigError if data.num_workers exceeds the CPUs of a node of the Ray the run uses: its
    actors all go on one node (one placement group), which could then never be placed."""
    cpus = node_cpus(cfg.cluster)
    if cpus is not None and cfg.data.num_workers > cpus:
        raise ConfigError(f"data.num_workers ({cfg.data.num_workers}) exceeds the {cpus:g} CPUs of the Ray the run "
                          f"uses (its actors share one node); set it to at most {max(1, int(cpus))}.")


def connect(cluster, log=print) -> None:
    """Connect this process to the Ray chosen by ``cluster.ray_address`` (a ClusterSection), once."""
    import ray

    if ray.is_initialized():  # the caller's Ray: its output during the run is quieted all the same
        console.quiet()
        return
    console.quiet()
    address, found = cluster_to_join(cluster)
    if address is not None and not found:
        _check_reachable(address)
    try:
        if address is None:
            missing = cluster.dashboard and _dashboard_missing()
            if missing:
                log(f"Ray dashboard: not started, its packages are missing ({missing}); install ray[default] "
                    "for it, or set cluster.dashboard=false to skip it")
            had_token = os.path.exists(os.path.expanduser(TOKEN_FILE))
            log("Ray: starting a private Ray on this machine for the run (its processes take a while to start "
                "on a small or busy machine)")
            with ray_in_own_session(), still(log, "Ray: starting"):
                ctx = ray.init(address="local", object_store_memory=cluster.object_store_memory,
                               include_dashboard=cluster.dashboard and not missing, dashboard_host=DASHBOARD_HOST,
                               log_to_driver=True)
            note = token_note(had_token)
            if note:
                log(note)
        elif found:
            log(f"joining the Ray cluster already running at {address}; set cluster.ray_address=local to "
                "start a private one")
            ctx = ray.init(log_to_driver=True)  # as plain ray.init() does: that cluster, with its token if any
        else:
            ctx = ray.init(address=address, log_to_driver=True)
    except (ray.exceptions.AuthenticationError, ConnectionError) as e:
        if isinstance(e, ConnectionError) and "InvalidAuthToken" not in str(e.__cause__):
            raise PipelineError(f"cannot reach the Ray cluster at {address!r} ({e}); start it with "
                                "`ray start --head` or fix cluster.ray_address (or RAY_ADDRESS).") from None
        raise PipelineError(f"the Ray cluster at {address} requires token authentication and this process has no "
                            "valid token; export RAY_AUTH_MODE=token and make the cluster's token available "
                            "(~/.ray/auth_token or RAY_AUTH_TOKEN), or set cluster.ray_address=local to start a "
                            "private Ray.") from None
    dashboard_url = getattr(ctx, "dashboard_url", None)  # a ray:// client's context may lack one
    log(endpoints_line(dashboard_url, address is None and not cluster.dashboard))
    console.quiet()  # again: ray.init installed the handler of the lines its processes print
    installed = grafana.install(_session_dir()) if dashboard_url else None
    if installed:
        console.keep(log, f"Grafana: the pipeline's dashboard is provisioned next to Ray's in {installed} (start Grafana with "
            f"--config {os.path.dirname(os.path.dirname(installed))}/grafana.ini; see the README)")


@contextlib.contextmanager
def ray_in_own_session():
    """Within the block, the processes a private Ray starts (all through Ray's ``ConsolePopen``) begin
    a session of their own, out of the driver's process group, so a signal to that group leaves them
    running (their workers, children of the raylet, follow it). Only where Ray ties its processes to
    the driver's life by the kernel (Linux): elsewhere its reaper kills them through the group."""
    from ray._private import services
    from ray._private.utils import detect_fate_sharing_support

    if sys.platform == "win32" or not detect_fate_sharing_support():
        yield
        return
    original = services.ConsolePopen

    class OwnSession(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "start_new_session": True})

    services.ConsolePopen = OwnSession
    try:
        yield
    finally:
        services.ConsolePopen = original


def _dashboard_missing() -> str:
    """What keeps this Ray from starting its dashboard (a plain ``ray`` install lacks its packages), or ""."""
    try:
        from ray._private.utils import get_dashboard_dependency_error
    except ImportError:  # another Ray version: let ray.init decide
        return ""
    error = get_dashboard_dependency_error()
    return "" if error is None else str(error)


def _session_dir() -> str | None:
    """This Ray session's directory on this machine (where Ray writes its Grafana setup), or None."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    try:
        return node.get_session_dir_path() if node is not None else None
    except Exception:
        return None


def metrics_endpoint() -> str | None:
    """The Prometheus endpoint (``http://ip:port/metrics``) of this process's Ray node, where the
    ``ray_megatrain_*`` gauges are exported; None if Ray reports no metrics port."""
    import ray

    try:
        own = ray.get_runtime_context().get_node_id()
        nodes = ray.nodes()
    except Exception:  # a ray:// client has no node of its own
        return None
    for node in nodes:
        if node["NodeID"] == own and node.get("MetricsExportPort"):
            return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    return None


def token_note(had_token: bool) -> str | None:
    """The line saying that starting Ray wrote its token to :data:`TOKEN_FILE` (the first start on this
    machine: Ray keeps it for every later start and the dashboard's log-in), or None if it was there."""
    if had_token or not os.path.exists(os.path.expanduser(TOKEN_FILE)):
        return None
    return (f"Ray: token authentication is on; Ray wrote its token to {TOKEN_FILE} (kept for later runs, "
            "`ray job` and the dashboard's log-in)")


def endpoints_line(dashboard_url: str | None, turned_off: bool) -> str:
    """The line printed at start: where the Ray dashboard is (and how to log in to it) and the node's
    metrics endpoint."""
    from ray._private.authentication import authentication_utils

    if dashboard_url:
        url = dashboard_url if "://" in dashboard_url else f"http://{dashboard_url}"
        token = (f" (log in with the token in {TOKEN_FILE})" if authentication_utils.is_token_auth_enabled()
                 else "")
        dashboard = f"Ray dashboard: {url}{token}"
    elif turned_off:
        dashboard = "Ray dashboard: off (cluster.dashboard=false)"
    else:
        dashboard = "Ray dashboard: none on this cluster"
    return f"{dashboard}; metrics: {metrics_endpoint() or 'not exported (Ray reports no metrics port)'}"


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """Fail in seconds, with one sentence, when a host:port Ray address does not answer."""
    if address == "auto" or address.startswith("ray://"):
        return
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise PipelineError(f"cannot reach the Ray cluster at {address!r} ({e.strerror or e}); start it with "
                            "`ray start --head` or fix cluster.ray_address (or RAY_ADDRESS).") from None


def in_job_copy() -> bool:
    """Whether this process is a Ray job's driver running in Ray's temporary copy of a working_dir."""
    job = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not job:
        return False
    try:
        runtime_env = json.loads(job).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return False
    return bool(runtime_env.get("working_dir"))


def job_path(path: str, what: str, log=print) -> str:
    """``path``, or in a Ray job's temporary working directory a relative ``path`` taken from
    :data:`JOB_OUTPUT_ROOT` instead (said in one line naming ``what`` sets it)."""
    if os.path.isabs(path) or not in_job_copy():
        return path
    resolved = os.path.join(os.path.expanduser(JOB_OUTPUT_ROOT), path)
    log(f"ray job: {what} {path!r} is taken from {JOB_OUTPUT_ROOT}, not from Ray's temporary copy of the working "
        f"directory: {resolved} (give an absolute path to choose)")
    return resolved


def connect_ray(cfg) -> None:
    """:func:`connect` for a whole TrainConfig: what the data layer is handed to reach Ray before
    tokenizing (see :data:`megatrain_ray.data.loader.Connect`); data.num_workers (the tokenizer pool's
    size) is checked against the CPUs before Ray starts and, for a cluster joined, once connected."""
    check_num_workers(cfg)
    connect(cfg.cluster)
    check_num_workers(cfg)


def lost() -> str | None:
    """What of Ray this process stands on has stopped accepting connections — the cluster's GCS, or
    this node's raylet (their process was killed, or the head node went away) — as the words that
    name it; None while both accept one, or where this process is not connected. Only a refused
    connection counts: a slow answer on a busy machine is not a death."""
    import ray

    try:
        from ray._private.worker import global_worker

        node = global_worker.node if ray.is_initialized() else None
        targets = [("GCS", node.gcs_address), ("raylet", f"{node.node_ip_address}:{node.node_manager_port}")]
    except Exception:  # noqa: BLE001 (not connected, or a Ray without these attributes: nothing to tell)
        return None
    for what, address in targets:
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=2.0).close()
        except (ConnectionRefusedError, ConnectionResetError):
            return f"Ray's {what} at {address}"
        except (OSError, ValueError):
            continue
    return None


def lost_error(what: str) -> PipelineError:
    """The sentence for :func:`lost`: nothing of the run can go on, and how to go on from its checkpoint."""
    return PipelineError(f"{what} stopped accepting connections (its process died, or its node went away), so the "
                         "run cannot go on; start Ray again (`ray start --head`) and resume the run.")

