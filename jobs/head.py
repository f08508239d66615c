"""A Ray head node for ``ray job submit`` that lives beside any other Ray on the machine.

    python jobs/head.py start      # a head on free ports, its own temp dir; prints its job address
    ray job submit --address "$(python jobs/head.py address)" --working-dir . -- python jobs/train.py ...
    python jobs/head.py stop       # stops this head only (``ray stop`` would stop every Ray of the user)

``ray start --head`` with its defaults takes fixed ports (6379 for the GCS, 8265 for the dashboard,
52365 for the dashboard's agent, 10001 for Ray client) and registers itself as the machine's "current
cluster"; beside another Ray the job server then fails ("No available agent to submit job") and
``ray job`` / ``ray.init()`` pick one of several clusters. Here every port Ray would fix is chosen
free (the others Ray picks itself), the head keeps its own temp dir (so it is nobody's "current
cluster"), and the address is given explicitly to every ``ray job`` command. ``start`` runs
``ray start --head --block`` in a session of its own and records it in :data:`STATE`
(``.ray-head.json`` in this directory): ``stop`` terminates that process, which stops the
processes it started, and then any process left with the head's temp dir on its command line.

Token authentication (``RAY_AUTH_MODE=token``, the token in ``~/.ray/auth_token``) is used as the
environment says; the head's log is ``<temp dir>/head.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

STATE = ".ray-head.json"
"""Where ``start`` records the head (in the current directory): pid, temp dir, addresses."""

START_TIMEOUT_S = 300
"""How long ``start`` waits for the head's job server to answer."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray() -> list[str]:
    """The ray CLI of this Python environment."""
    here = os.path.join(os.path.dirname(sys.executable), "ray")
    return [here if os.path.exists(here) else shutil.which("ray") or "ray"]


def _read_state() -> dict | None:
    try:
        with open(STATE) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _answers(address: str) -> bool:
    proc = subprocess.run([*_ray(), "job", "list", "--address", address], capture_output=True, text=True)
    return proc.returncode == 0


def start(num_cpus: int | None) -> int:
    state = _read_state()
    if state and _alive(state["pid"]):
        print(f"error: a head started here is running (pid {state['pid']}, job address {state['address']}); "
              f"stop it with `python jobs/head.py stop` first.", file=sys.stderr)
        return 2
    temp = tempfile.mkdtemp(prefix="mtr-head-", dir="/tmp")  # short: Ray's socket paths stay < 108 bytes
    gcs, dashboard = _free_port(), _free_port()
    address = f"http://127.0.0.1:{dashboard}"
    log_path = os.path.join(temp, "head.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*_ray(), "start", "--head", "--block", f"--port={gcs}", "--dashboard-host=127.0.0.1",
             f"--dashboard-port={dashboard}", f"--dashboard-agent-listen-port={_free_port()}",
             f"--ray-client-server-port={_free_port()}", f"--temp-dir={os.path.join(temp, 'ray')}",
             *([f"--num-cpus={num_cpus}"] if num_cpus else [])],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    state = {"pid": proc.pid, "temp_dir": temp, "address": address, "gcs": f"127.0.0.1:{gcs}", "log": log_path}
    with open(STATE, "w") as f:
        json.dump(state, f, indent=2)
    print(f"starting a Ray head on free ports (GCS {state['gcs']}, job server {address}), its log in {log_path}",
          file=sys.stderr)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _answers(address):
        if proc.poll() is not None:
            tail = open(log_path).read()[-2000:]
            print(f"error: the Ray head exited with status {proc.returncode} before its job server answered; "
                  f"its log ({log_path}) ends:\n{tail}", file=sys.stderr)
            _stop(state)
            return 1
        if time.monotonic() > deadline:
            print(f"error: the Ray head's job server did not answer within {START_TIMEOUT_S} s; see {log_path}.",
                  file=sys.stderr)
            _stop(state)
            return 1
        time.sleep(2)
    print(f"Ray head ready: submit with `ray job submit --address {address} ...`; "
          "stop it with `python jobs/head.py stop`", file=sys.stderr)
    print(address)
    return 0


def _processes_of(temp: str) -> list[int]:
    """Processes whose command line names ``temp`` (the head's temp dir), this one aside."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if temp in cmdline:
                pids.append(int(entry))
    return pids


def _stop(state: dict, wait_s: float = 60.0) -> None:
    pid = state["pid"]
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)  # `ray start --block` stops the processes it started
        deadline = time.monotonic() + wait_s
        while _alive(pid) and time.monotonic() < deadline:
            try:
                os.waitpid(pid, os.WNOHANG)  # reaps it when this process started it
            except ChildProcessError:
                pass
            time.sleep(0.5)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    for left in _processes_of(state["temp_dir"]):
        try:
            os.kill(left, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(state["temp_dir"], ignore_errors=True)
    try:
        os.remove(STATE)
    except FileNotFoundError:
        pass


def stop() -> int:
    state = _read_state()
    if state is None:
        print(f"error: no head was started from this directory ({STATE} is missing); nothing stopped.",
              file=sys.stderr)
        return 2
    _stop(state)
    print(f"stopped the Ray head at {state['address']} (pid {state['pid']}); any other Ray runs on", file=sys.stderr)
    return 0


def address() -> int:
    state = _read_state()
    if state is None or not _alive(state["pid"]):
        print("error: no head started from this directory is running; start one with "
              "`python jobs/head.py start`.", file=sys.stderr)
        return 2
    print(state["address"])
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python jobs/head.py", description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=("start", "address", "stop"))
    ap.add_argument("--num-cpus", type=int, default=None, help="CPUs the head offers (default: Ray's, all of them)")
    args = ap.parse_args(argv)
    return {"start": lambda: start(args.num_cpus), "address": address, "stop": stop}[args.command]()


if __name__ == "__main__":
    sys.exit(main())
