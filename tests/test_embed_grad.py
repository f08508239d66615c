"""The embedding's backward (:mod:`megatrain_ray.engine.compute.embed_grad`): the same sums as ``index_add_``,
in a fixed order, so that a GPU run is the same on every run and a resumed run equals a straight one.

On the CPU, ``index_add_`` adds the tokens' rows one after another in token order, which is exactly
the order :func:`add_embedding_grad` sums them in: the two must agree bit for bit, in float32 and
float64 (and from a bf16 input gradient). Against an independent formulation (a dense one-hot
matrix product in float64) the float64 result must agree to the rounding of a sum of at most N
terms: |error| <= N * eps64 * sum|x| ~ 700 * 1.1e-16 * 700 * 4 ~ 2e-10 for the inputs below (|x| <= ~4),
so 1e-9 is a bound, not a fit.

The GPU tests (skipped without CUDA): the same input gives the same bits on every run, with
``torch.use_deterministic_algorithms(True)`` raising on any operation PyTorch knows to be
nondeterministic; and 3 steps + checkpoint + resume + 3 steps equal 6 straight steps bit for bit
through the real pipeline on the GPU.
"""

import json
import os

import numpy as np
import pytest
import torch

from megatrain_ray.engine.compute.embed_grad import add_embedding_grad

from artifacts import read_tensors


def _case(seed: int, vocab=50, hidden=16, n=700, dtype=torch.float32, device="cpu"):
    """ids [n] with heavy repeats (one id 100 times, every id several times), dx [n, H], a nonzero table [V, H]
    (as with tied embeddings, where the LM head's gradient is already in it)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n,), generator=g)
    ids[torch.randperm(n, generator=g)[:100]] = 7
    dx = (torch.randn(n, hidden, generator=g) * 2).to(dtype)
    table = torch.randn(vocab, hidden, generator=g, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    return ids.to(device), dx.to(device), table.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equals_the_cpu_index_add_bit_for_bit(dtype, seed):
    ids, dx, table = _case(seed, dtype=dtype)
    old = table.clone().index_add_(0, ids, dx.to(table.dtype))
    new = table.clone()
    add_embedding_grad(new, ids, dx)
    assert torch.equal(new, old)
    assert not torch.equal(new, table)  # it did add something


def test_equals_a_dense_one_hot_product_in_float64():
    ids, dx, table = _case(3, dtype=torch.float64)
    new = table.clone()
    add_embedding_grad(new, ids, dx)
    one_hot = torch.nn.functional.one_hot(ids, table.shape[0]).to(torch.float64)  # [N, V]
    expected = table + one_hot.T @ dx
    assert (new - expected).abs().max().item() < 1e-9


def test_micro_batches_accumulate_like_one_index_add_each():
    """The compute worker calls it once per micro-batch into the same table, as it called index_add_."""
    table_old, table_new = torch.zeros(50, 16), torch.zeros(50, 16)
    for seed in range(3):
        ids, dx, _ = _case(seed)
        table_old.index_add_(0, ids, dx)
        add_embedding_grad(table_new, ids, dx)
    assert torch.equal(table_new, table_old)


def test_edge_cases_one_id_all_ids_distinct_and_no_tokens():
    table = torch.zeros(8, 4)
    dx = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    add_embedding_grad(table, torch.full((8,), 3), dx)  # one group of every token
    assert torch.equal(table[3], dx.sum(0)) and table.abs().sum() == table[3].abs().sum()
    table = torch.zeros(8, 4)
    add_embedding_grad(table, torch.arange(7, -1, -1), dx)  # every id once, in reverse
    assert torch.equal(table, dx.flip(0))
    add_embedding_grad(table, torch.zeros(0, dtype=torch.long), torch.zeros(0, 4))
    assert torch.equal(table, dx.flip(0))


# ---------------------------------------------------------------------------------------------
# On the GPU.

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_the_same_bits_on_every_run_on_the_gpu():
    """32k tokens of a 4096-id vocabulary (every id ~8 times, one id 2,000 times), hidden 1024, bf16."""
    g = torch.Generator().manual_seed(0)
    n, vocab, hidden = 32768, 4096, 1024
    ids = torch.randint(0, vocab, (n,), generator=g)
    ids[torch.randperm(n, generator=g)[:2000]] = 11
    dx = torch.randn(n, hidden, generator=g).to(torch.bfloat16)
    ids_d, dx_d = ids.cuda(), dx.cuda()
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # raises on any op PyTorch knows to be nondeterministic
    try:
        results = []
        for _ in range(10):
            table = torch.zeros(vocab, hidden, device="cuda")
            add_embedding_grad(table, ids_d, dx_d)
            results.append(table.cpu())
    finally:
        torch.use_deterministic_algorithms(before)
    assert all(torch.equal(r, results[0]) for r in results[1:])
    # And it is the gradient: against float64 on the CPU, within fp32 summation error. The longest sum
    # has 2,000 terms of unit variance, so partial sums of size ~sqrt(2000) ~ 45, each addition rounded
    # by up to 6e-8 of that: a random walk of 2,000 such errors is ~6e-8 * 45 * 45 ~ 1.2e-4; 1e-3 is ~8 sigma.
    expected = torch.zeros(vocab, hidden, dtype=torch.float64).index_add_(0, ids, dx.to(torch.float64))
    assert (results[0].double() - expected).abs().max().item() < 1e-3




@cuda
def test_three_steps_resume_three_steps_equal_six_straight_on_the_gpu(ray_cluster, shm_dir, tmp_path):
    """On the GPU, 3 steps + checkpoint + resume + 3 steps give the weights, AdamW states,
    losses and grad norms of 6 straight steps, bit for bit (the embedding gradient was the one tensor
    that differed, by 3.6e-8, while it was summed with atomics)."""
    from megatrain_ray.config import load_config
    from megatrain_ray.io import checkpoint
    from megatrain_ray.orchestration.pipeline import train

    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(0).integers(0, 512, size=100_000))  # small vocabulary: many repeats

    def cfg(run_dir):
        return load_config(None, [
            "model.hidden_size=256", "model.intermediate_size=704", "model.num_hidden_layers=4",
            "model.num_attention_heads=8", "model.num_key_value_heads=2", "model.vocab_size=512",
            "train.seq_len=256", "train.micro_batch_size=4", "train.num_micro_batches=3", "train.steps=6",
            "train.checkpoint_every=3", "train.keep_checkpoints=6", f"data.path={data}", "compute.device=cuda",
            f"memory.shm_dir={shm_dir}", f"train.run_dir={run_dir}"])

    straight = train(cfg(tmp_path / "a"), log=lambda line: None)
    step3 = os.path.join(straight.run_dir, "checkpoints", "step-000003")
    assert checkpoint.read_meta(step3)["step"] == 3
    resumed = train(cfg(tmp_path / "b"), log=lambda line: None, resume=step3)

    a, b = (read_tensors(os.path.join(r.run_dir, "checkpoints", "step-000006")) for r in (straight, resumed))
    assert a.keys() == b.keys() and len(a) > 0
    differ = {k: (a[k].double() - b[k].double()).abs().max().item() for k in a if not torch.equal(a[k], b[k])}
    assert not differ, f"{len(differ)} of {len(a)} tensors differ: {differ}"
    rows = [[json.loads(line) for line in open(os.path.join(r.run_dir, "metrics.jsonl"))] for r in (straight, resumed)]
    assert [r["step"] for r in rows[1]] == [4, 5, 6]
    assert [(r["loss"], r["grad_norm"]) for r in rows[1]] == [(r["loss"], r["grad_norm"]) for r in rows[0][3:]]
    assert not torch.equal(read_tensors(step3)["model.embed_tokens.weight"], b["model.embed_tokens.weight"])
    assert os.listdir(shm_dir) == []
