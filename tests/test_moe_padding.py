"""The load-balancing loss of a mixture of experts on padded rows, against transformers given the
attention mask (what a padding trainer passes it): padding is routed and computed like any token but
stays out of the loss's f, P and row count.

- Model level: our sparse layers' statistics with the rows' attention mask give transformers'
  ``aux_loss`` of the same padded batch with that mask, which differs from the loss without it (so
  the padding matters in this test).
- End to end: padded SFT rows (pre-tokenized, with a prompt and a response) through the compute
  worker (single-process driver, fp32 CPU; sparse layers recomputed and kept whole): the batch
  carries the attention mask, and step 0's ``aux_loss`` is router_aux_loss_coef x the mean over micro-batches of transformers' aux_loss of each
  micro-batch with its attention mask.
"""

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from artifacts import MOE_ARCHS, make_model, token_ids  # noqa: E402

from megatrain_ray.errors import ConfigError  # noqa: E402
from megatrain_ray.io import hf_io  # noqa: E402
from megatrain_ray.model import moe  # noqa: E402
from megatrain_ray.model.transformer import decoder_layer, rope_cache, routed_layer, unit_names  # noqa: E402


def _padded_mask(batch: int, seq: int) -> torch.Tensor:
    """[batch, seq] int64 attention mask: row r keeps its first seq - 5 r tokens (row 0 unpadded)."""
    return (torch.arange(seq)[None, :] < (seq - 5 * torch.arange(batch))[:, None]).long()


@pytest.mark.parametrize("arch", sorted(MOE_ARCHS))
def test_aux_loss_of_padded_rows_matches_transformers_given_the_attention_mask(arch, tmp_path):
    model = make_model(arch, output_router_logits=True)
    model.save_pretrained(tmp_path / "hf")
    if arch == "glm4_moe":  # transformers computes no load-balancing loss for it: the setting is refused
        with pytest.raises(ConfigError, match=r"model\.output_router_logits must be false for glm4_moe"):
            hf_io.read_config(str(tmp_path / "hf"))
        return
    cfg, _ = hf_io.read_config(str(tmp_path / "hf"))
    mapping = hf_io.check_weights(cfg, str(tmp_path / "hf"), "the checkpoint")
    ids, mask = token_ids(batch=3, seq=16), _padded_mask(3, 16)
    with torch.no_grad():
        theirs = model(input_ids=ids, attention_mask=mask).aux_loss
        unmasked = model(input_ids=ids).aux_loss
    units = {u: hf_io.read_unit(str(tmp_path / "hf"), mapping, cfg, u) for u in unit_names(cfg)}
    x = torch.nn.functional.embedding(ids, units["embed"]["weight"])
    rope = rope_cache(cfg, ids.shape[1], ids.device, torch.float32)
    stats = []
    for i in range(cfg.num_hidden_layers):
        p = units[f"layers.{i}"]
        if i in cfg.sparse_layers:
            x, s = routed_layer(p, x, rope, cfg, None, mask.bool())
            stats.append(s)
        else:
            x = decoder_layer(p, x, rope, cfg)
    torch.testing.assert_close(moe.aux_loss(stats, cfg.num_experts), theirs.float(), rtol=1e-6, atol=1e-7)
    assert abs(float(theirs) - float(unmasked)) > 1e-4 * float(theirs)  # the padding matters here
    # The padding is still routed: the counts of computed rows include it, the loss's f does not.
    assert all(int(s.counts.sum()) == ids.numel() * cfg.num_experts_per_tok for s in stats)
    assert all(int(s.assigned.sum()) == int(mask.sum()) * cfg.num_experts_per_tok for s in stats)


def _sft_rows(path, lengths: list[int]) -> None:
    """Pre-tokenized SFT rows (input_ids, labels with a two-token prompt) as an Arrow file."""
    import pyarrow as pa

    rng = np.random.default_rng(0)
    examples = [rng.integers(1, 96, size=n).tolist() for n in lengths]
    labels = [[-100, -100] + e[2:] for e in examples]
    table = pa.table({"input_ids": examples, "labels": labels})
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)


@pytest.mark.parametrize("activations", ["recompute", "keep"])
def test_padded_sft_rows_aux_loss_through_the_compute_worker_matches_transformers(activations, shm_dir, tmp_path):
    from megatrain_ray.data.loader import source_from_config
    from megatrain_ray.io.hf_io import load_train_config
    from megatrain_ray.orchestration.local import train_local

    model = make_model("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.5)
    model.save_pretrained(tmp_path / "hf")
    _sft_rows(tmp_path / "sft.arrow", [16, 7, 12, 4, 16, 9, 3, 14])
    cfg = load_train_config(None, [
        f"train.init_from={tmp_path / 'hf'}", f"data.path={tmp_path / 'sft.arrow'}", "data.format=tokens",
        "train.seq_len=15", "train.micro_batch_size=2", "train.num_micro_batches=2", "train.steps=1",
        "compute.device=cpu", "precision.compute_dtype=float32", f"memory.shm_dir={shm_dir}",
        f"memory.activations={activations}",
        f"train.run_dir={tmp_path / 'runs'}", "train.save_final=false", "train.checkpoint_every=0"])
    assert cfg.model.output_router_logits and cfg.model.router_aux_loss_coef == 0.5
    batch = source_from_config(cfg).batch(0)
    mask = torch.tensor(batch["attention_mask"])  # [M, B, S]
    ids = torch.tensor(batch["input_ids"])
    assert mask.shape == ids.shape and not mask.all()  # some rows are padded
    with torch.no_grad():
        per_mb = [model(input_ids=ids[m], attention_mask=mask[m].long()).aux_loss for m in range(len(ids))]
        without = [model(input_ids=ids[m]).aux_loss for m in range(len(ids))]
    expected = 0.5 * float(sum(per_mb)) / len(per_mb)
    assert abs(0.5 * float(sum(without)) / len(without) - expected) > 1e-4 * expected
    (row,) = train_local(cfg, 0)
    assert row["aux_loss"] == pytest.approx(expected, rel=1e-5)


def test_rows_carry_the_attention_mask_of_their_padding(tmp_path):
    from megatrain_ray.config import load_config
    from megatrain_ray.data.loader import source_from_config

    _sft_rows(tmp_path / "sft.arrow", [5, 4, 7, 3])
    common = [f"data.path={tmp_path / 'sft.arrow'}", "data.format=tokens", "train.seq_len=6",
              "train.micro_batch_size=1", "train.num_micro_batches=1", "model.vocab_size=96",
              f"train.run_dir={tmp_path / 'runs'}"]
    plain = source_from_config(load_config(None, common)).samples(np.arange(4))
    # a row's inputs are its first 6 tokens, padded after its own
    assert plain["attention_mask"].tolist() == [[True] * n + [False] * (6 - n) for n in (5, 4, 6, 3)]
    packed = source_from_config(load_config(None, [*common, "data.pack_documents=true", "train.seq_len=10"]))
    rows = packed.samples(np.arange(packed.num_samples))
    assert packed.num_samples == 2  # [5 + 4] and [7 + 3]
    assert rows["attention_mask"].tolist() == [[True] * 9 + [False], [True] * 10]
