"""The micro-batch split `megatrain-ray plan` advises (megatrain_ray.orchestration.splits): each split it
names is the plan of that split, run for run; a micro-batch that does not fit the device is never
advised; and a split that saves less than a twentieth of the step, or a CPU run, gets no line."""

import re

import pytest

from megatrain_ray import cli
from megatrain_ray.config import load_config
from megatrain_ray.orchestration.resolve import Facts, resolve
from megatrain_ray.orchestration.splits import ADVISED_SAVING, faster_splits, split_note

GIB = 2**30
MOE = ["model.model_type=qwen3_moe", "model.vocab_size=32000", "model.hidden_size=1024", "model.num_hidden_layers=6",
       "model.num_attention_heads=8", "model.num_key_value_heads=4", "model.num_experts=64",
       "model.num_experts_per_tok=2", "model.moe_intermediate_size=1024", "model.intermediate_size=2816",
       "train.seq_len=1024", "train.micro_batch_size=1", "train.num_micro_batches=16", "optim.placement=host"]
"""A mixture of many experts whose 16 micro-batches of one sequence give each expert 32 rows."""


def _run(sets, gpu_gib=80):
    cfg = load_config(None, sets)
    return resolve(cfg, Facts("cuda", int(gpu_gib * GIB), host_bytes=64 * GIB))


def _split(sets, n: int, each: int) -> list[str]:
    return [*sets, f"train.num_micro_batches={n}", f"train.micro_batch_size={each}"]


def test_each_split_advised_is_the_plan_of_that_split():
    run = _run(MOE)
    now = run.updates.step_s(run.pace)
    splits = faster_splits(run)
    assert [(n, each) for n, each, _ in sorted(splits)] == [(1, 16), (2, 8), (4, 4), (8, 2)]
    for n, each, step_s in splits:
        other = _run(_split(MOE, n, each))
        assert other.decisions.resident == run.decisions.resident
        assert step_s == other.updates.step_s(other.pace)
    # fewer micro-batches: fewer unit passes and expert-weight reads, the same FLOPs
    assert [s for *_, s in sorted(splits)] == sorted(s for *_, s in splits) and splits[-1][2] < now
    note = split_note(run)
    best = [f"{n} x {each} ~" for n, each, s in splits if s <= now * (1 - ADVISED_SAVING)]
    assert best and note.startswith("micro-batches: the step's 16 sequences in fewer, larger micro-batches would be "
                                    f"faster: {best[0]}")
    assert all(b in note for b in best[:3]) and "against ~" in note and "as 16 x 1" in note


def test_a_micro_batch_that_does_not_fit_the_device_is_never_advised():
    small = _run(MOE, gpu_gib=8)
    largest = small.memory.largest_micro_batch
    assert 1 <= largest < 16
    splits = faster_splits(small)
    assert splits and all(each <= largest for _, each, _ in splits)
    assert (1, 16) not in [(n, each) for n, each, _ in splits]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_no_line_where_no_split_saves_a_twentieth_of_the_step_or_on_a_cpu(device, capsys, tmp_path, monkeypatch):
    """The 7B shape at 4 micro-batches of 16 x 1,024 with the H200 box's 15 AdamW threads: 2 of 32
    saves the pace ~1.5% (half the unit passes), below a twentieth; a CPU run is never advised."""
    monkeypatch.chdir(tmp_path)
    dense = ["model.model_type=qwen2", "model.vocab_size=152064", "model.hidden_size=3584",
             "model.intermediate_size=18944", "model.num_hidden_layers=28", "model.num_attention_heads=28",
             "model.num_key_value_heads=4", "train.seq_len=1024", "train.micro_batch_size=16",
             "train.num_micro_batches=4", "parallel.optimizer_threads=15"]
    if device == "cuda":
        run = _run(dense, gpu_gib=139)
        now = run.updates.step_s(run.pace)
        splits = faster_splits(run)
        assert splits and all(now * (1 - ADVISED_SAVING) < s < now for *_, s in splits)
        assert split_note(run) is None
        moe = sum((["--set", s] for s in _split(MOE[:-3], 16, 1)), [])
        cli.main(["plan", "--device", "cuda", "--gpu-memory", "80", "--host-memory", "64", *moe])
        assert re.search(r"^micro-batches: the step's 16 sequences in fewer", capsys.readouterr().out, re.M)
    else:
        cli.main(["plan", "--device", "cpu", *sum((["--set", s] for s in _split(MOE[:-3], 16, 1)), [])])
        assert "micro-batches:" not in capsys.readouterr().out
        assert faster_splits(_run_cpu(_split(MOE[:-3], 16, 1))) == []


def _run_cpu(sets):
    return resolve(load_config(None, sets), Facts("cpu", host_bytes=64 * GIB))
