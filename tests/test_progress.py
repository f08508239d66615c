"""What a run says while it waits (megatrain_ray.progress, orchestration.step_notes): lines during a
long wait (Ray starting, tokenizing, a long step, with the units the step has done), and an eta from
the pace of the recent steps that two steps ending together, or one slow step, do not throw off.
"""

import json
import re
import threading

import pytest

from megatrain_ray.config import load_config
from megatrain_ray.orchestration.step_notes import StepNotes
from megatrain_ray.progress import Eta, still


def test_still_says_a_line_while_the_block_runs_and_leaves_no_thread():
    lines, two = [], threading.Event()

    def log(line):
        lines.append(line)
        if len(lines) == 2:
            two.set()

    with still(log, "Ray: starting", every_s=0.01, detail=lambda: ", 3 of 8 things"):
        assert two.wait(60), lines  # the block runs on: lines keep coming
    count = len(lines)
    assert all(re.fullmatch(r"Ray: starting: \d+ s so far, 3 of 8 things", line) for line in lines), lines
    assert not [t for t in threading.enumerate() if t.name.startswith("still: ")]
    assert len(lines) == count  # and none after it ended


def test_eta_is_the_mean_pace_of_recent_steps():
    eta = Eta(window=3)
    eta.step(10.0, 9.0)  # the first step (compile, warm-up): no pace from it
    assert eta.left_s(50) is None and eta.left_s(0) == 0.0
    eta.step(10.1, 38.0)  # in flight beside the first, ended 0.1 s after it: its run time is the pace
    assert eta.left_s(10) == pytest.approx(380.0)
    eta.step(50.0, 38.0)
    eta.step(88.0, 37.0)
    assert eta.left_s(10) == pytest.approx((38.0 + 39.9 + 38.0) / 3 * 10)
    eta.step(126.0, 38.0)  # the window moves on
    assert eta.left_s(1) == pytest.approx((39.9 + 38.0 + 38.0) / 3)


class _FetchQueue:
    def __init__(self):
        self.count = 0

    def taken(self, within=None):
        return self.count


def test_a_long_step_says_how_far_it_is():
    lines, q = [], _FetchQueue()
    notes = StepNotes(lines.append, 60, q, every_s=0.0)
    notes.waiting(0)  # the driver starts waiting for step 1
    q.count = 7
    notes.waiting(0)
    assert lines == ["still on step 1/60: 0 s so far, 7 weight units through the compute worker"]
    notes.ended({"fetches": {"layers": 8, "embed": 1, "head": 1}, "step_s": 40.0})  # long: counted from here
    q.count = 12
    notes.waiting(1)
    notes.waiting(1)
    assert lines[-1] == "still on step 2/60: 0 s so far, 5 of 10 weight units through the compute worker"
    notes.ended({"fetches": {"layers": 8}, "step_s": 0.001})  # short steps: no call to count them
    q.count = 99
    notes.waiting(2)
    notes.waiting(2)
    assert lines[-1] == "still on step 3/60: 0 s so far"
    quiet = StepNotes(lines.append, 60, q, every_s=3600.0)
    quiet.waiting(0)
    quiet.waiting(0)
    assert len(lines) == 3  # within a note's interval: nothing


def test_tokenizing_says_so_before_it_starts(ray_cluster, tmp_path):
    from megatrain_ray.data.loader import source_from_config

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(50)))
    cfg = load_config(None, [f"data.path={docs}", "data.format=text", "data.num_workers=1",
                             f"train.run_dir={tmp_path / 'runs'}"])
    lines = []
    source_from_config(cfg, log=lines.append)
    said = [ln for ln in lines if ln.startswith("data: tokeniz")]
    assert re.match(rf"data: tokenizing data.path '{re.escape(str(docs))}' with 1 tokenizer actor\(s\), once: "
                    r"the cache is ", said[0]), said
    assert said[-1].startswith("data: tokenized data.path")
