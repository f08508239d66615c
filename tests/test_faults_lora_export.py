"""``megatrain-ray export`` of a LoRA run's checkpoint (the adapters alone): the base the run took,
with the adapters merged in, as a model transformers loads, and the adapters as a directory PEFT
loads; the merged weights equal PEFT's merge of those adapters into that base."""

import json
import os
import uuid

import pytest
import torch

from megatrain_ray import cli
from megatrain_ray.config import load_config
from megatrain_ray.engine.store.host_store import ParameterStore, StoreSpec
from megatrain_ray.io import lora_checkpoint
from megatrain_ray.io.checkpoint import CheckpointSettings
from megatrain_ray.model.lora import AdapterLayout
from megatrain_ray.model.precision import resolve_precision

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def test_a_lora_checkpoint_exports_as_the_merged_model_and_its_adapters(tmp_path, shm_dir, capsys):
    sets = ["train.steps=4", "compute.device=cpu", "lora.rank=4", "lora.alpha=8", f"memory.shm_dir={shm_dir}",
            f"train.run_dir={tmp_path / 'runs'}", "train.seed=3"]
    cfg = load_config(None, sets)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({**cfg.to_dict(), "device": "cpu"}))
    g = torch.Generator().manual_seed(0)  # adapters as training left them (lora_B no longer zero)
    layout = AdapterLayout.build(cfg.model, cfg.lora)
    states = {unit: {kind: 0.1 * torch.randn(t.numel, generator=g) for kind in lora_checkpoint.STATE_KINDS}
              for unit, t in layout.trained}
    ckpt = lora_checkpoint.save(CheckpointSettings(str(run / "checkpoints"), 2, 2, cfg.to_dict(), "r", {}), 2,
                                cfg.model, cfg.lora, states)
    # The base the run trained on: train.seed's draw, as an HF directory for PEFT's reference merge.
    spec = StoreSpec.of_run(cfg, resolve_precision(cfg.precision, "cpu"), "cpu", os.getpid(), "b-" + uuid.uuid4().hex[:6])
    base = ParameterStore(spec, cfg.train.seed)
    try:
        base.save_hf(str(tmp_path / "base"))
    finally:
        base.close()

    for src, out in ((ckpt, tmp_path / "out"), (str(run), tmp_path / "out-of-run")):  # the checkpoint, or its run
        assert cli.main(["export", src, "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        assert printed.startswith(f"exported {ckpt} to {out}: the base with the LoRA adapters merged in, "), printed
        assert printed.rstrip().endswith(f"the adapters (PEFT) in {out / 'adapter'}")
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
    reference = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")).float(),
        str(tmp_path / "out" / "adapter")).merge_and_unload().state_dict()
    ours = merged.state_dict()
    assert ours.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-6, atol=1e-6, msg=key)
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")).state_dict()
    assert any(not torch.equal(ours[k], plain[k]) for k in ours if "q_proj" in k)  # the adapters are in it
    assert os.listdir(shm_dir) == []
