"""What a run shows on the terminal, and its log file (``runs/<id>/train.log``) that keeps everything.

:class:`Console` is the ``log`` callback of a run: each line goes to the terminal (stdout, or the
caller's callback) and to the run's log file. Writing to the terminal never raises: when stdout is
a pipe whose reader is gone (``... | tee`` and tee killed by the same Ctrl-C) or a terminal that
hung up, the console falls silent (the stream is pointed at ``/dev/null``, so neither Ray's threads
nor Python's exit flush fail on it either) and the file keeps the lines; so a line logged while the
interrupt checkpoint is saved can never abort the save. Lines logged before the run's directory
exists are kept pending and written first when the file is opened (:meth:`Console.attach`).

Output that the user cannot act on goes to the active console's file only (:func:`quiet`):

- Python log records of Ray listed in :data:`QUIET_RECORDS` (dropped when no run is active), and
  once a role of the run died (:meth:`Console.failed`), every "Unhandled error" of Ray's: the error
  of a call of the attempt that failed, whose result no one asked for any more (the run says what
  died in its own sentence). Ray reports those when the calls' references are freed, which may be
  after the run has ended (its error being printed, the process exiting): they go to that run's
  file too, until another run starts;
- lines Ray forwards from its processes (``(pid=...) ...``) that match :data:`QUIET_LINES`, the
  crash report of a Ray process whose internal check failed as it died (:data:`RAY_FATAL`), and
  every line of Ray's own daemons (:data:`QUIET_DAEMONS`: the raylet, the GCS), whose accounts of a
  worker, an actor or a node that died the run gives in its own sentence (the role that died, Ray
  or a node gone: :mod:`megatrain_ray.orchestration.calls`, :mod:`megatrain_ray.orchestration.cluster`);
- warnings listed in :data:`QUIET_WARNINGS`.

Every other line Ray prints still shows.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
import warnings

LOG_FILE = "train.log"
"""The run's log file, in its run directory."""

QUIET_RECORDS = (
    # Ray turns token authentication on by default and says so on every start; it stays on.
    ("ray._private.authentication.authentication_token_setup", "Token authentication is enabled for this Ray cluster"),
    # ray.init's progress lines; connect() prints its own line when it joins a running cluster.
    ("ray._private.worker", "Started a local Ray instance"),
    ("ray._private.worker", "Connecting to existing Ray cluster at address"),
    ("ray._private.worker", "Connected to Ray cluster"),
    # It guesses a crashed cluster; connect() raises one error saying what failed instead.
    ("ray._private.worker", "Failed to connect to the default Ray cluster address"),
    # megatrain_ray.datasets turns Ray Data's progress bars off (the data step logs its own line).
    ("ray.data._internal.progress", "Progress bars disabled"),
    # Calls still pending on the actors a run's teardown kills (ray.kill) once it ended or was
    # interrupted: their results are not wanted.
    ("ray._private.worker", "Unhandled error", "killed by `ray.kill`"),
    # MLflow creating its local store (train.loggers: mlflow), and the migrations that make it.
    ("mlflow.store.db.utils", ""),
    ("alembic.runtime.migration", ""),
)
"""(logger, message prefix[, a text the message must also hold]) of the log records (Ray's, and
the trackers' libraries') kept out of the terminal."""

UNHANDLED = ("ray._private.worker", "Unhandled error")
"""Ray's record of an error of a call whose result nobody read (once the run failed: the file only)."""

QUIET_LINES = (
    # Ray Data's JSON reader tries pyarrow first, which reads JSON lines only; a JSON array (an
    # Alpaca file) is then read by json.load, as it should be. The line after it is pyarrow's error.
    ("Falling back to native json.load()", 1),
    # The GCS reports actors of an ended run that were already gone when the teardown killed them.
    ("Failed to kill actor", 0),
    # gloo (the collectives of parallel.nodes > 1) on a node whose peer's node went away: the role
    # that died with that node is named by the run (a restart, or the error).
    ("Connection closed by peer", 0),
    ("gloo/transport", 0),
)
"""(text, lines that follow it) of the lines forwarded from Ray's processes kept out of the terminal."""

QUIET_DAEMONS = ("raylet", "gcs_server", "autoscaler")
"""The ``pid`` Ray forwards the lines of its own daemons under; all of them go to the run's file only."""

RAY_FATAL = "An unexpected system state has occurred"
"""What a Ray process prints when one of its internal checks fails, as it dies (e.g. a worker whose
call arguments' pipe broke as it was killed): that line and every later one of that process (its
stack trace, in as many batches as Ray forwards it in) go to the run's file only; the run says what
died in its own sentence."""

QUIET_WARNINGS = (
    # Ray Data's actor pool (the tokenizers, data.num_workers of them) was given fewer blocks than
    # actors: a small corpus, tokenized in less time than another block split would take.
    "The minimum number of concurrent actors",
)
"""Message prefixes of the warnings kept out of the terminal."""

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
"""A terminal escape sequence (Ray colours the prefixes of the lines it forwards), kept out of the file."""

_active: list[Console] = []
"""The console of the run in progress (the newest last)."""

_ended_failed: list[str] = []
"""The log file of the last run, while no run is active, if a role of it died (see the module docstring)."""


class Console:
    """A run's ``log`` callback: see the module docstring. ``show``: where the terminal's lines go
    (default: print to stdout)."""

    def __init__(self, show=None):
        self.show_line = show
        self.silent = False
        self.file = None
        self.pending: list[str] = []
        self.lock = threading.Lock()
        self.depth = 0
        self.failing = False
        """Set once a role of the run died (:meth:`failed`)."""

    def __call__(self, line: str) -> None:
        self.keep(line)
        self.show(line)

    def show(self, line: str) -> None:
        """The line on the terminal, unless it is gone (then nothing, from now on)."""
        if self.silent:
            return
        try:
            if self.show_line is None:
                print(line, flush=True)
            else:
                self.show_line(line)
        except (OSError, ValueError):  # a closed pipe (EPIPE), a hung-up terminal (EIO), a closed file
            self.silent = True
            if self.show_line is None:
                silence(sys.stdout)

    def keep(self, line: str) -> None:
        """The line in the run's log file (pending until it is opened), without terminal colour codes."""
        stamped = f"{time.strftime('%H:%M:%S')} {ANSI.sub('', line)}"
        with self.lock:
            if self.file is None:
                self.pending.append(stamped)
                return
            try:
                self.file.write(stamped + "\n")
                self.file.flush()
            except (OSError, ValueError):  # a full disk must not stop the run either
                pass

    def failed(self) -> None:
        """A role of the run died: from now on Ray's reports of the errors of calls nobody reads go
        to the file only (see the module docstring)."""
        self.failing = True

    def attach(self, run_dir: str) -> str:
        """Open ``run_dir``'s log file (appending) and write the lines pending so far; its path."""
        path = os.path.join(run_dir, LOG_FILE)
        with self.lock:
            if self.file is None:
                self.file = open(path, "a")
                self.file.writelines(line + "\n" for line in self.pending)
                self.file.flush()
                self.pending = []
        return path

    def close(self) -> None:
        with self.lock:
            if self.file is not None:
                if self.failing:
                    _ended_failed[:] = [self.file.name]
                self.file.close()
                self.file = None

    def __enter__(self) -> Console:
        """While the block runs, this is the console whose file the quiet output goes to."""
        self.depth += 1
        _active.append(self)
        _ended_failed.clear()
        return self

    def __exit__(self, *exc) -> None:
        _active.remove(self)
        self.depth -= 1
        if not self.depth:
            self.close()


def console(log=None) -> Console:
    """``log`` as a :class:`Console` (itself if it is one; print to stdout if None or ``print``)."""
    if isinstance(log, Console):
        return log
    return Console(None if log in (None, print) else log)


def keep(log, line: str) -> None:
    """``line`` in the run's log file only: ``log``'s if it is a :class:`Console`, else the active run's."""
    if isinstance(log, Console):
        log.keep(line)
    else:
        _keep_only(line)


def failed(log) -> None:
    """``log``'s run (or the active one) had a role die: see :meth:`Console.failed`."""
    target = log if isinstance(log, Console) else (_active[-1] if _active else None)
    if target is not None:
        target.failed()


def say(text: str, stream=None) -> None:
    """Print ``text`` to ``stream`` (stderr by default), silently nothing if it is a closed pipe."""
    stream = sys.stderr if stream is None else stream
    try:
        print(text, file=stream, flush=True)
    except (OSError, ValueError):
        silence(stream)


def silence(stream) -> None:
    """Point ``stream``'s file descriptor at /dev/null (a pipe whose reader is gone stays writable,
    and what is buffered for it flushes there)."""
    try:
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except (OSError, ValueError, AttributeError):
        pass


def _keep_only(line: str) -> None:
    if _active:
        _active[-1].keep(line)


def _append(path: str, line: str) -> None:
    """``line`` at the end of the closed log file ``path``, without terminal colour codes (nothing if
    it cannot be written)."""
    try:
        with open(path, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {ANSI.sub('', line)}\n")
    except OSError:
        pass


class _QuietRecords(logging.Filter):
    def __init__(self, rules: tuple[tuple[str, ...], ...]):
        super().__init__()
        self.rules = rules

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        rules = self.rules
        if record.name == UNHANDLED[0] and not _active and _ended_failed and msg.startswith(UNHANDLED[1]):
            _append(_ended_failed[0], f"[{record.name}] {record.getMessage()}")
            return False
        if _active and _active[-1].failing and record.name == UNHANDLED[0]:
            rules = ((UNHANDLED[1],), *rules)
        for prefix, *also in rules:
            if msg.startswith(prefix) and all(text in msg for text in also):
                _keep_only(f"[{record.name}] {record.getMessage()}")
                return False
        return True


class _QuietLines:
    """Ray's handler of lines forwarded from its processes, minus :data:`QUIET_LINES`, the lines of
    :data:`QUIET_DAEMONS` and those of a process from its :data:`RAY_FATAL` line on (kept in the
    run's file, with every line shown)."""

    def __init__(self, handler):
        self.handler = handler
        self.dying: set = set()
        """The processes that printed :data:`RAY_FATAL`."""

    def __call__(self, data: dict, *args, **kwargs) -> None:
        lines, shown, skip = data.get("lines") or [], [], 0
        name = data.get("actor_name") or data.get("task_name")
        pid = data.get("pid")
        who = f"({name + ' ' if name else ''}pid={pid})"
        for line in lines:
            _keep_only(f"{who} {line}")
            if RAY_FATAL in line:
                self.dying.add(pid)
            if pid in QUIET_DAEMONS or pid in self.dying:
                continue
            if skip:
                skip -= 1
                continue
            rule = next((follow for text, follow in QUIET_LINES if text in line), None)
            if rule is None:
                shown.append(line)
            else:
                skip = rule
        if shown or not lines:
            self.handler({**data, "lines": shown}, *args, **kwargs)


_showwarning = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None):
    if str(message).startswith(QUIET_WARNINGS):
        _keep_only(f"[{category.__name__}] {message}")
        return
    _showwarning(message, category, filename, lineno, file, line)


def quiet() -> None:
    """Keep the output listed in the module docstring out of the terminal (idempotent; call again
    after ``ray.init``, which installs the handler of forwarded lines)."""
    global _showwarning
    by_logger: dict[str, tuple] = {}
    for name, *rule in QUIET_RECORDS:
        by_logger[name] = by_logger.get(name, ()) + (tuple(rule),)
    for name, rules in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietRecords) for f in logger.filters):
            logger.addFilter(_QuietRecords(rules))
    if warnings.showwarning is not _show_warning:
        _showwarning, warnings.showwarning = warnings.showwarning, _show_warning
    try:
        from ray._private import worker
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:  # another Ray version: its lines all show
        return
    dispatcher.handlers = [(name, _QuietLines(h) if name == "ray_print_logs" and not isinstance(h, _QuietLines)
                            else h) for name, h in dispatcher.handlers]
    # The errors the GCS publishes to the driver (a raylet that died, a node marked dead) are printed
    # by Ray's error listener straight through this function, as lines of the raylet.
    if not isinstance(getattr(worker, "print_to_stdstream", None), _QuietLines):
        printer = worker.print_to_stdstream
        worker.print_to_stdstream = _QuietLines(lambda data, ignore_prefix=False: printer(data, ignore_prefix))
