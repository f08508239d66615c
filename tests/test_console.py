"""What a run shows and what its log file keeps (megatrain_ray.orchestration.console): a closed
pipe silences the terminal and never raises; Ray's output the user cannot act on (the teardown's
unhandled errors of killed actors, Ray Data's JSON fallback line, its actor-pool warning) goes to
the run's log file only, everything else still shows."""

import json
import os
import subprocess
import sys
import time

import pytest
import ray

from megatrain_ray.orchestration import console


def test_lines_go_to_the_terminal_and_the_file_and_a_closed_pipe_silences_only_the_terminal(tmp_path):
    shown = []
    out = console.Console(shown.append)
    out("before the run directory exists")
    out.attach(str(tmp_path))
    out("after")

    def gone(line):
        raise BrokenPipeError(32, "Broken pipe")

    out.show_line = gone
    out("into a closed pipe")  # no exception
    out.show_line = shown.append
    out("later")  # the terminal stays silent once it failed
    out.close()
    kept = [line.split(" ", 1)[1] for line in (tmp_path / console.LOG_FILE).read_text().splitlines()]
    assert kept == ["before the run directory exists", "after", "into a closed pipe", "later"]
    assert shown == ["before the run directory exists", "after"]


def test_print_into_a_pipe_whose_reader_is_gone_falls_silent_and_exits_cleanly(tmp_path):
    """The default console (print to stdout) in a process whose stdout reader has gone: no
    exception, no 'Exception ignored' at exit (stdout is pointed at /dev/null), status 0."""
    code = ("import sys, time; from megatrain_ray.orchestration import console\n"
            "c = console.Console(); c.attach(sys.argv[1])\n"
            "c('first'); sys.stdin.readline()\n"
            "for i in range(100): c(f'line {i}')\n"
            "c.close(); console.say('done', sys.stdout)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "first\n"
    proc.stdout.close()  # the reader is gone
    proc.stdin.write("go\n")
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0
    assert proc.stderr.read() == ""
    assert (tmp_path / console.LOG_FILE).read_text().count("line ") == 100


def test_unhandled_errors_of_actors_the_teardown_killed_go_to_the_file_only(ray_cluster, tmp_path, caplog):
    """Ray reports a result nobody read of a call on an actor that ray.kill ended (the teardown's
    kill) through its worker logger: that record goes to the file; another error still shows."""
    console.quiet()

    @ray.remote
    class Sleeper:
        def wait(self):
            time.sleep(600)

    actor = Sleeper.remote()
    ref = actor.wait.remote()
    ray.kill(actor)
    with pytest.raises(ray.exceptions.ActorDiedError) as info:
        ray.get(ref, timeout=120)
    with console.Console(lambda line: None) as out:
        out.attach(str(tmp_path))
        ray._private.worker._unhandled_error_handler(info.value)  # what Ray calls for an unread error
        ray._private.worker._unhandled_error_handler(ValueError("a real problem"))
    shown = "\n".join(r.getMessage() for r in caplog.records)  # what reached the handlers (Ray's: stderr)
    assert "ray.kill" not in shown and "a real problem" in shown
    kept = (tmp_path / console.LOG_FILE).read_text()
    assert "Unhandled error" in kept and "ray.kill" in kept


def test_lines_of_rays_daemons_and_of_gloo_go_to_the_file_only(tmp_path):
    """What Ray forwards when a node or a worker dies (the raylet's account, gloo's error on the
    surviving peer) goes to the run's file; an actor's own line still shows."""
    shown = []
    forward = console._QuietLines(lambda data: shown.extend(data["lines"]))
    with console.Console(lambda line: None) as out:
        out.attach(str(tmp_path))
        forward({"pid": "raylet", "lines": ["Raylet is terminated. Termination is unexpected.",
                                            "    [state-dump] NodeManager.GCTaskFailureReason - 1 total"]})
        forward({"pid": 123, "actor_name": "GradientSink", "lines": [
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [192.0.2.2]:4711",
            "a line of the sink's own"]})
    assert shown == ["a line of the sink's own"]
    kept = (tmp_path / console.LOG_FILE).read_text()
    assert "Raylet is terminated" in kept and "[state-dump]" in kept
    assert "(GradientSink pid=123) [../third_party/gloo" in kept


def test_the_crash_report_of_a_ray_worker_killed_mid_call_goes_to_the_file_only(tmp_path):
    """A tokenizer actor killed (SIGTERM) as it took a call: Ray's failed check and its stack trace,
    which Ray forwards in more than one batch (as Ray 2.60 printed it), go to the file; another
    process's line still shows, and so do the killed process's lines before its crash."""
    shown = []
    forward = console._QuietLines(lambda data: shown.extend(data["lines"]))
    worker = {"pid": 18511, "actor_name": "MapWorker(MapBatches(TokenizeBatch))"}
    with console.Console(lambda line: None) as out:
        out.attach(str(tmp_path))
        forward({**worker, "lines": ["a line of the tokenizer's own",
                                     "[2026-12-05 20:36:27,487 C 18511 18554] core_worker.cc:515:  An unexpected "
                                     "system state has occurred. You have likely discovered a bug in Ray. Check "
                                     "failed: raylet_ipc_client_->WaitForActorCallArgs(args, task_id, attempt_number) "
                                     "Status not OK: IOError: Broken pipe", "*** StackTrace Information ***"]})
        forward({**worker, "lines": ["/venv/lib/python3.11/site-packages/ray/_raylet.so(+0x114e42b) "
                                     "[0x7f8626f4e42b] EventTracker::RecordExecution()"]})
        forward({"pid": 4711, "actor_name": "GradientSink", "lines": ["a line of the sink's own"]})
    assert shown == ["a line of the tokenizer's own", "a line of the sink's own"]
    kept = (tmp_path / console.LOG_FILE).read_text()
    assert "Check failed: raylet_ipc_client_" in kept and "EventTracker::RecordExecution" in kept


def test_errors_the_gcs_publishes_as_the_raylets_go_to_the_file_only(tmp_path, capfd):
    """The errors the GCS publishes to the driver (a raylet that died, a node marked dead), which Ray's
    error listener prints as lines of the raylet: to the file; a worker's line printed the same way shows."""
    from ray._private import worker

    console.quiet()
    with console.Console(lambda line: None) as out:
        out.attach(str(tmp_path))
        worker.print_to_stdstream({"lines": ["Raylet is terminated. Termination is unexpected."], "pid": "raylet",
                                   "is_err": False}, ignore_prefix=False)  # as listen_error_messages calls it
        worker.print_to_stdstream({"lines": ["a worker's own line"], "pid": 4711, "is_err": False}, ignore_prefix=False)
    printed = capfd.readouterr().out
    assert "Raylet is terminated" not in printed and "a worker's own line" in printed
    assert "(pid=raylet) Raylet is terminated" in (tmp_path / console.LOG_FILE).read_text()


def test_unhandled_errors_after_a_role_died_go_to_the_file_only(ray_cluster, tmp_path, caplog):
    """Once the run had a role die (a restart follows, or the run's error), Ray's reports of the errors
    of the failed attempt's calls that nobody reads go to the file; before that, one shows."""
    console.quiet()
    with console.Console(lambda line: None) as out:
        out.attach(str(tmp_path))
        ray._private.worker._unhandled_error_handler(ValueError("before any death"))
        console.failed(out)
        ray._private.worker._unhandled_error_handler(ValueError("PipelineError: fetch out of order"))
    shown = "\n".join(r.getMessage() for r in caplog.records)
    assert "before any death" in shown and "fetch out of order" not in shown
    assert "fetch out of order" in (tmp_path / console.LOG_FILE).read_text()


_READ_ALPACA = """
import json, sys, time, warnings
import ray
from megatrain_ray.orchestration import console

ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=True)
console.quiet()
with console.Console() as out:
    out.attach(sys.argv[2])
    rows = ray.data.read_json([sys.argv[1]], lines=False).take_all()
    deadline = time.monotonic() + 60  # the read task's lines reach the driver a little later
    while "Falling back" not in open(out.file.name).read() and time.monotonic() < deadline:
        time.sleep(0.5)
    warnings.warn("The minimum number of concurrent actors for 'x' is set to 2", UserWarning)
    warnings.warn("something else", UserWarning)
    out(f"rows {len(rows)}")
ray.shutdown()
"""


def test_ray_data_json_fallback_line_and_actor_pool_warning_go_to_the_file_only(tmp_path):
    """A JSON array (an Alpaca file) read by Ray Data: pyarrow's attempt fails and Ray Data says it
    falls back to json.load, in a read task whose lines Ray forwards to the driver (printed with
    colours); that line and pyarrow's error after it go to the file. Ray Data's warning of an actor
    pool given fewer blocks than actors too; other warnings show. A process of its own, with Ray's
    forwarding of its processes' lines on (the tests' Ray has it off)."""
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps([{"instruction": "say hi", "input": "", "output": "hi"}] * 20))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", _READ_ALPACA, str(path), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rows 20" in proc.stdout
    kept = (tmp_path / console.LOG_FILE).read_text()
    assert "Falling back to native json.load()" in kept and "JSON parse error" in kept
    shown = proc.stdout + proc.stderr
    assert "Falling back" not in shown and "JSON parse error" not in shown
    assert "The minimum number of concurrent actors" not in shown and "something else" in shown
    assert "The minimum number of concurrent actors" in kept


def test_the_gcs_lines_of_actors_already_gone_go_to_the_file_only(tmp_path):
    """A batch of lines as Ray's log monitor forwards it from the GCS after a teardown (its shape as
    Ray 2.60 emits it): every line of the GCS goes to the file (its accounts of actors, workers and
    nodes that died are what the run says in its own sentence)."""
    printed = []
    handler = console._QuietLines(printed.append)
    data = {"ip": "10.0.0.1", "localhost": "10.0.0.1", "pid": "gcs_server", "job": "", "is_err": True,
            "actor_name": "", "task_name": "",
            "lines": ["[2026-01-01 00:00:00,000 W 1 2] gcs_actor_manager.cc:1: Failed to kill actor 0123, "
                      "status: RpcError: RPC Error message: Socket closed; RPC Error details:",
                      "gcs_placement_group_scheduler.cc:273: Failed to remove 4 bundle(s) for placement group 07"]}
    with console.Console(lambda line: None) as out:
        out.attach(str(tmp_path))
        handler(data)
    assert printed == []
    kept = (tmp_path / console.LOG_FILE).read_text()
    assert "(pid=gcs_server)" in kept and "Failed to kill actor 0123" in kept and "Failed to remove 4 bundle(s)" in kept


def test_the_start_up_says_what_the_store_holds_and_where_its_weights_come_from():
    """A large model's start-up takes minutes (its weights drawn or read into the store): the line before it."""
    import dataclasses

    from megatrain_ray.config import load_config
    from megatrain_ray.engine.store.host_store import StoreSpec
    from megatrain_ray.model.layout import StoreLayout
    from megatrain_ray.model.precision import resolve_precision
    from megatrain_ray.orchestration.pipeline import _start_line

    cfg = load_config(None, ["memory.shm_dir=/dev/shm", "model.hidden_size=256", "model.num_hidden_layers=4"])
    spec = StoreSpec.of_run(cfg, resolve_precision(cfg.precision, "cpu"), "cpu", os.getpid(), "x")
    params = StoreLayout.build(cfg.model).num_params
    line = _start_line(spec, None, None, 1)
    assert line == (f"starting the roles: the store fills {spec.nbytes() / 2**20:.1f} MiB of /dev/shm with "
                    f"{params / 1e6:.1f}M parameters from random weights (train.seed)")
    assert _start_line(spec, "/ckpt/step-10", None, 2).endswith("on each node with "
                                                               f"{params / 1e6:.1f}M parameters from the checkpoint /ckpt/step-10")
    lora = dataclasses.replace(spec, lora=dataclasses.replace(spec.lora, rank=4))
    assert lora.lora.enabled
    assert _start_line(lora, "/ckpt/step-10", "/hf/base", 1).endswith(
        "from /hf/base, the adapters from the checkpoint /ckpt/step-10")
