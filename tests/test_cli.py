"""The ``megatrain-ray`` command line, run as a real subprocess.

User errors: exit status 2, one ``error:`` line on stderr, no traceback, nothing written.
The default run (no arguments at all): starts its own local Ray (printing none of Ray's lines the
user cannot act on), trains the tiny preset and its loss falls.
"""

import json
import os
import re
import statistics
import subprocess
import sys

import pytest

from processes import finish

from megatrain_ray.config import TrainSection

STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+) \| loss ([0-9.]+) \|")
RAY_NOISE = ("Token authentication is enabled", "Started a local Ray instance", "Connecting to existing Ray cluster",
             "Connected to Ray cluster", "has constructor arguments in the object store", "Progress bars disabled",
             "ray_remote_args` is deprecated")
"""Ray log lines a run must not print (see megatrain_ray.orchestration.cluster.quiet_ray_logs)."""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.setdefault("RAY_DEDUP_LOGS", "0")
    return env


def _cli(args, cwd, timeout):
    return subprocess.run([sys.executable, "-m", "megatrain_ray.cli", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args,named", [
    (["train", "--set", "optim.lr=0"], "optim.lr"),
    (["train", "--config", "missing.yaml"], "missing.yaml"),
    (["train", "--set", "foo.bar=1"], "foo"),
    (["train", "--set", "optim.lrr=0.1"], "optim.lrr"),
    (["train", "--set", "optim.lr"], "optim.lr"),
])
def test_user_error_exits_2_with_one_error_line(tmp_path, args, named):
    proc = _cli(args, tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    assert named in lines[0]
    assert proc.stdout == ""
    # Failed before any work: no run directory, nothing at all written in the working directory.
    assert list(tmp_path.iterdir()) == []


def test_malformed_yaml_exits_2(tmp_path):
    (tmp_path / "bad.yaml").write_text("optim: {lr: [1, 2\n")
    proc = _cli(["train", "--config", "bad.yaml"], tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "not valid YAML" in lines[0] and "bad.yaml" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_no_command_is_a_usage_error(tmp_path):
    proc = _cli([], tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "usage:" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow  # the whole default run, its eval, export and plots: ~2 min
def test_default_run_trains_and_the_loss_falls(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "megatrain_ray.cli", "train"], cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = finish(proc, 240)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err
    # None of Ray's lines that the user cannot act on (token auth stays on, without saying so each run).
    for noise in RAY_NOISE:
        assert noise not in out + err, err[-3000:]
    assert not re.search(r"^joining the Ray cluster", out, re.M)  # no cluster runs here: a private one

    # Progress lines: every step 1..M, in order, with the default step count.
    steps, losses = [], []
    for line in out.splitlines():
        m = STEP_LINE.match(line)
        if m:
            steps.append(int(m.group(1)))
            assert int(m.group(2)) == TrainSection().steps
            losses.append(float(m.group(3)))
    total = TrainSection().steps
    assert steps == list(range(1, total + 1)), out[-2000:]
    assert all(0 < x < 20 for x in losses)
    # The loss falls clearly: a byte-level model starts near ln(260) = 5.56 nats.
    assert losses[0] > 4.5
    assert losses[-1] <= losses[0] - 0.5, (losses[0], losses[-1])
    assert statistics.mean(losses[-5:]) < statistics.mean(losses[:5]) - 1.0, losses
    assert re.search(r"^done: \d+ steps, final loss [0-9.]+", out, re.M)

    # The run directory: config, one metrics row per step, final HF checkpoint.
    run_dirs = list((tmp_path / "runs").iterdir())
    assert len(run_dirs) == 1
    run_dir = run_dirs[0]
    # The dashboard's address is shown once; the Grafana provisioning path only in the run's log file,
    # which also keeps every line shown.
    assert out.count("Ray dashboard: http") == 1 and "Grafana" not in out + err
    # Ray's start-up is said before it begins (it takes a while on a small machine), not after
    assert out.index("Ray: starting a private Ray on this machine") < out.index("Ray dashboard: http")
    log = (run_dir / "train.log").read_text()
    assert "\x1b[" not in log  # Ray's colour codes stay on the terminal
    assert "Grafana: the pipeline's dashboard is provisioned" in log
    assert all(line in log for line in out.splitlines() if line.startswith(("step", "done:")))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, total + 1))  # the log's count
    assert [round(r["loss"], 4) for r in rows] == pytest.approx(losses, abs=1e-4)
    assert all(r["grad_norm"] > 0 and r["lr"] > 0 and r["tokens"] > 0 for r in rows)
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["train"]["steps"] == total
    final = run_dir / "final"
    assert (final / "config.json").is_file()
    assert (final / "model.safetensors.index.json").is_file()
    assert list(final.glob("*.safetensors"))
    assert (final / "tokenizer.json").is_file()  # byte-level, as a Hugging Face tokenizer
    assert json.loads((final / "config.json").read_text())["eos_token_id"] == 256
    assert re.search(r"^step +1/\d+ \|.* \| eta \.\.\.$", out, re.M)  # no ETA from the compile step

    # The README's next commands on this run, as written there.
    ev = _cli(["eval", f"runs/{run_dir.name}"], tmp_path, timeout=180)
    assert ev.returncode == 0, ev.stderr
    m = re.search(r"^eval: val loss ([0-9.]+) \| perplexity [0-9.]+ \| [\d,]+ tokens", ev.stdout, re.M)
    assert m and float(m.group(1)) < losses[0] - 0.5, ev.stdout  # held-out text the run never saw
    ex = _cli(["export", f"runs/{run_dir.name}", "--out", "my-model"], tmp_path, timeout=120)
    assert ex.returncode == 0, ex.stderr
    assert "tokenizer.json" in ex.stdout and (tmp_path / "my-model" / "tokenizer.json").is_file()

    # The run removed its shared-memory segments from the default memory.shm_dir.
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith(f"megatrain-{proc.pid}-")] \
        if os.path.isdir("/dev/shm") else []
    assert leftovers == []


def test_help_describes_every_command_and_argument_and_version_is_printed(capsys):
    """--help in plain words (no reStructuredText markup), a description for every command and a help
    line for every argument, positional ones included; --version."""
    import argparse

    from megatrain_ray import __version__, cli

    parser = cli._parser()
    assert "``" not in parser.format_help() and ":mod:" not in parser.format_help()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, sub in commands.choices.items():
        if name in cli._FORWARDED:
            continue
        assert sub.description, name
        for action in sub._actions:
            assert action.help, (name, action.dest)
    from megatrain_ray import bench

    assert all(action.help for action in bench.parser()._actions), [a.dest for a in bench.parser()._actions
                                                                     if not a.help]
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"megatrain-ray {__version__}"


def test_export_shard_size_takes_units():
    from megatrain_ray.cli import parse_size

    assert [parse_size(t) for t in ("10MB", "2GiB", "1.5G", "123", "500M", "1KiB")] == [
        10_000_000, 2 * 2**30, int(1.5 * 2**30), 123, 500 * 2**20, 1024]
    args = __import__("megatrain_ray.cli", fromlist=["_parser"])._parser().parse_args(
        ["export", "runs/x", "--out", "m", "--shard-size", "10MB"])
    assert args.shard_size == 10_000_000
    for bad in ("10XB", "-5MB", "MB"):  # (0 parses: the export refuses it in one sentence, test_refused_weights)
        with pytest.raises(Exception):
            parse_size(bad)
