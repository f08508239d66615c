"""What the documents and help texts promise against what the code does, where they had parted:

- ``export --help`` names generation_config.json with the condition under which it is written (a
  run from scratch with the byte-level tokenizer writes none);
- the README names the Grafana path where the run writes it (train.log) and hard-codes no Ray
  session folder;
- ``train.eval_every`` reports a validation loss at the last step too;
- train.log holds Ray's lines without the terminal's colour codes;
- the first Ray start that writes Ray's token file says so.
"""

import os
import re

from megatrain_ray import cli
from megatrain_ray.config import load_config
from megatrain_ray.io.generation import write_generation_config
from megatrain_ray.orchestration import cluster, console

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_export_help_says_when_generation_config_is_written(tmp_path, capsys):
    try:
        cli.main(["export", "--help"])
    except SystemExit:
        pass
    text = " ".join(capsys.readouterr().out.split())
    assert re.search(r"also generation_config\.json where the run's base model \(train\.init_from\) has one", text)
    assert "a run from scratch with the built-in byte-level tokenizer has none" in text
    from megatrain_ray.data.tokenizer import save_byte_tokenizer

    save_byte_tokenizer(str(tmp_path / "tok"))
    assert write_generation_config(None, str(tmp_path), str(tmp_path / "tok")) == []  # as the help says


def test_readme_names_where_the_grafana_path_is_written():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "session_latest" not in readme and "it prints the path" not in readme
    assert "grep Grafana: runs/<run id>/train.log" in readme
    source = open(os.path.join(ROOT, "megatrain_ray", "orchestration", "cluster.py")).read()
    assert 'console.keep(log, f"Grafana: ' in source  # the line the README greps for, in train.log


def test_eval_every_also_validates_at_the_last_step():
    train = load_config(None, ["train.steps=7", "train.eval_every=3"]).train
    assert [s for s in range(7) if train.eval_due(s)] == [0, 3, 6]
    train = load_config(None, ["train.steps=8", "train.eval_every=3"]).train
    assert [s for s in range(8) if train.eval_due(s)] == [0, 3, 6, 7]
    assert not any(load_config(None, ["train.steps=8"]).train.eval_due(s) for s in range(8))


def test_train_log_keeps_no_terminal_colour_codes(tmp_path):
    log = console.Console(show=lambda line: None)
    log("\x1b[36m(raylet)\x1b[0m a line Ray coloured")
    path = log.attach(str(tmp_path))
    log.keep("\x1b[33m(pid=12, ip=10.0.0.1)\x1b[0m \x1b[1;31mwarning\x1b[0m: kept")
    log.close()
    text = open(path).read()
    assert "\x1b" not in text
    assert text.splitlines()[0].endswith(" (raylet) a line Ray coloured")
    assert text.splitlines()[1].endswith(" (pid=12, ip=10.0.0.1) warning: kept")


def test_the_ray_start_that_writes_the_token_file_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cluster.token_note(had_token=False) is None  # no token written: nothing to say
    os.makedirs(tmp_path / ".ray")
    (tmp_path / ".ray" / "auth_token").write_text("t")
    assert cluster.token_note(had_token=True) is None  # there before this start
    note = cluster.token_note(had_token=False)
    assert note.startswith("Ray: token authentication is on; Ray wrote its token to ~/.ray/auth_token")
