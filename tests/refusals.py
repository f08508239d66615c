"""Shared by the tests of refused input (test_refused_*.py, test_last_good_checkpoint.py,
test_faults_messages.py): run the real command line and check its one error sentence, snapshot a
directory to show nothing changed, and the module-scoped inputs they refuse (a tiny real Hugging Face
checkpoint, a run directory holding one real checkpoint).
"""

import hashlib
import os
import shutil

import pytest
import torch

from megatrain_ray import cli
from megatrain_ray.config import load_config
from megatrain_ray.data.loader import source_from_config
from megatrain_ray.engine.store.host_store import ParameterStore, StoreSpec
from megatrain_ray.io import writer
from megatrain_ray.model.precision import Precision

transformers = pytest.importorskip("transformers")


def refused(argv, cwd, capsys, monkeypatch) -> str:
    """cli.main(argv) in ``cwd``; asserts status 2 and one error line; returns that line."""
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert status == 2, (out, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def snapshot(root) -> dict[str, str]:
    """{relative path: sha256} of every file under root."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny real Llama checkpoint written by transformers' save_pretrained."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("hf") / "llama"
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def run_with_checkpoint(tmp_path_factory):
    """A run directory holding one real checkpoint (step 2 of 4) of the default tiny model."""
    base = tmp_path_factory.mktemp("ckpt")
    shm_dir = base / "shm"
    shm_dir.mkdir()
    cfg = load_config(None, [f"memory.shm_dir={shm_dir}", f"train.run_dir={base / 'runs'}", "train.steps=4",
                             "compute.device=cpu"])
    spec = StoreSpec(cfg.model, Precision(torch.float32, torch.float32), str(shm_dir), os.getpid(), "bad-input")
    ps = ParameterStore(spec, 0)
    try:
        for i in range(len(ps.store.layout.units)):
            ps.store.set_version(i, 2)
        run = base / "runs" / "run-1"
        data_state = {k: v for k, v in source_from_config(cfg).state(0).items() if k != "next_step"}
        writer.save(ps.store, str(run / "checkpoints"), 2, cfg.to_dict(), "run-1", data_state)
    finally:
        ps.close()
    return run


def copy_run(run, tmp_path):
    dst = tmp_path / "copied-run"
    shutil.copytree(run, dst)
    return dst


def refused_train(tmp_path, capsys, monkeypatch, shm_dir, *sets: str) -> str:
    """The error line of ``megatrain-ray train --set memory.shm_dir=SHM --set ...`` in tmp_path."""
    argv = ["train", "--set", f"memory.shm_dir={shm_dir}"]
    for s in sets:
        argv += ["--set", s]
    return refused(argv, tmp_path, capsys, monkeypatch)
