"""Long context: the sequence-tiled MLP is the untiled layer's math, and packed documents (masked
attention, per-document positions) give each document the losses and gradients it has alone.

Tolerances (fp32 on the CPU, unit roundoff u = 6e-8). Tiled against untiled, the per-token values
are the same operations on the same rows; what changes is the order in which the weight gradients
are summed over the S*B tokens (per chunk, then across chunks) and the GEMMs' blocking. A sum of n
terms reordered moves by at most ~n*u times the sum of their magnitudes and in practice by
~sqrt(n)*u relative to the largest terms: for n = 2 x 1536 tokens, ~3e-6; so 1e-5 of the largest
magnitude of each tensor is a bound that a real difference (a dropped chunk, a missing residual, a
wrong mask: all O(1) relative) cannot meet. Packed against per-document HF runs: masked keys add
exp(-inf) = 0 exactly, so the only differences are again summation order and blocking, over
sequences of <= 128 tokens and a 3-layer model: the same 1e-5 relative.
"""

import numpy as np
import pytest
import torch

from megatrain_ray.config import ModelConfig, load_config
from megatrain_ray.data.packing import IGNORE_INDEX as DATA_IGNORE
from megatrain_ray.data.packing import document_positions, eos_starts, pack_rows, packed_row
from megatrain_ray.engine.compute.sequence import LayerRunner, attention_mask, step_contexts
from megatrain_ray.errors import ConfigError
from megatrain_ray.model import transformer as M
from megatrain_ray.model.layout import LayerTemplate

transformers = pytest.importorskip("transformers")


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    """Max |got - want| within rel of max |want| (see the module docstring)."""
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} > {rel} x {scale:.3g}"


def _layer(cfg, seed=0):
    t = LayerTemplate.build(cfg, "layers.0")
    flat = torch.randn(t.numel, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.1
    flat = flat.float()
    for name, _, _ in t.params:  # norms near 1, as trained ones are
        if name.endswith("norm.weight"):
            t.bind(flat)[name].add_(1.0)
    return t, flat


CFG = ModelConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64, max_position_embeddings=4096)


def _forward_backward(runner, t, flat, x, dy, ctx):
    with torch.no_grad():
        y = runner.forward(t.bind(flat, fused=True), x, ctx, CFG)
    grad = torch.zeros(t.numel)
    leaves = {k: w.detach().requires_grad_(True) for k, w in t.bind(flat, fused=True).items()}
    dx = runner.backward(leaves, t.bind(grad, fused=True), x, dy, ctx, CFG)
    return y, dx, grad


def packed_against_each_document(device: str, dtype: torch.dtype, chunk: int = 0, wrap=None):
    """One layer over three documents packed into a 2048-token sequence (the packed path: step_contexts'
    mask, a FlexAttention BlockMask on CUDA, dense on the CPU) and over each document alone (its
    positions from 0, plain causal SDPA), both in ``dtype``, against the per-document run in float64.

    Returns (packed error, per-document error): the largest relative errors (max |got - want| over
    max |want|) of the output, the input gradient and the weight gradient (the documents' summed).
    The per-document run in ``dtype`` is the trusted path's own rounding, what the packed one may
    deviate by (up to a small factor: its kernel blocks and sums differently)."""
    cfg = load_config(None, ["model.hidden_size=256", "model.intermediate_size=704", "model.num_attention_heads=8",
                             "model.num_key_value_heads=2", "model.max_position_embeddings=4096"]).model
    t, flat = _layer(cfg)
    lengths, s = (700, 1000, 348), 2048
    g = torch.Generator().manual_seed(1)
    x, dy = (torch.randn(1, s, cfg.hidden_size, generator=g, dtype=torch.float64).to(device) for _ in range(2))
    flat = flat.double().to(device)
    pos = torch.cat([torch.arange(n) for n in lengths]).to(device)[None, None]

    def layer(runner, w, x, dy, ctx):
        with torch.no_grad():
            y = runner.forward(t.bind(w, fused=True), x, ctx, cfg)
        grad = torch.zeros(t.numel, device=device, dtype=torch.float32 if w.dtype != torch.float64 else w.dtype)
        leaves = {k: v.detach().requires_grad_(True) for k, v in t.bind(w, fused=True).items()}
        return y, runner.backward(leaves, t.bind(grad, fused=True), x, dy, ctx, cfg), grad

    def per_document(w, x, dy):
        ys, dxs, grad, at = [], [], 0, 0
        for n in lengths:
            ctx = (M.rope_cache(cfg, n, torch.device(device), x.dtype), None)
            y, dx, gw = layer(LayerRunner(0), w, x[:, at:at + n], dy[:, at:at + n], ctx)
            ys, dxs, grad, at = ys + [y], dxs + [dx], grad + gw.double(), at + n
        return torch.cat(ys, 1), torch.cat(dxs, 1), grad

    want = per_document(flat, x, dy)
    ctx = step_contexts(cfg, pos, 1, s, torch.device(device), dtype)[0]
    packed = layer(LayerRunner(chunk, wrap), flat.to(dtype), x.to(dtype), dy.to(dtype), ctx)
    alone = per_document(flat.to(dtype), x.to(dtype), dy.to(dtype))

    def err(got):
        return max(float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip(got, want))

    return err(packed), err(alone), ctx


@pytest.mark.parametrize("chunk", [0, 512])
def test_the_packed_layer_is_each_document_alone_on_the_cpu(chunk):
    """packed_against_each_document on the CPU (the dense mask), fp32: both within a few fp32 ulps
    (1e-5, see the module docstring) of the float64 per-document run."""
    packed, alone, ctx = packed_against_each_document("cpu", torch.float32, chunk)
    assert isinstance(ctx[1], torch.Tensor) and packed < 1e-5 and alone < 1e-5, (packed, alone)


@pytest.mark.parametrize("packed", [False, True])
def test_tiled_mlp_equals_untiled_forward_and_gradients(packed):
    """A 1536-token sequence (x2) in chunks of 400 (the last one short): the layer's output, its
    input gradient and every weight gradient match the untiled layer to 1e-5 relative."""
    t, flat = _layer(CFG)
    b, s = 2, 1536
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(b, s, CFG.hidden_size, generator=gen)
    dy = torch.randn(b, s, CFG.hidden_size, generator=gen)
    pos = None
    if packed:  # documents of uneven lengths, different in each row
        cuts = [[0, 300, 1100], [0, 17, 900, 901]]
        pos = torch.stack([torch.from_numpy(document_positions(np.array(c), 0, s)[0]) for c in cuts])[None]
    ctx = step_contexts(CFG, pos, 1, s, torch.device("cpu"), torch.float32)[0]
    tiled = LayerRunner(400)
    assert tiled.tiles(x) and not LayerRunner(0).tiles(x) and not LayerRunner(s).tiles(x)
    want = _forward_backward(LayerRunner(0), t, flat, x, dy, ctx)
    got = _forward_backward(tiled, t, flat, x, dy, ctx)
    for g, w in zip(got[:2], want[:2]):
        _close(g, w)
    for name, _, _ in t.params:
        _close(t.bind(got[2])[name], t.bind(want[2])[name])
    assert got[2].abs().min() >= 0 and (t.bind(got[2])["mlp.down_proj.weight"] != 0).all()
    with torch.no_grad():  # and the model's own decoder_layer is the untiled runner
        _close(M.decoder_layer(t.bind(flat), x, ctx[0], CFG, ctx[1]), want[0], rel=1e-6)


def test_runner_wraps_both_halves_when_tiled():
    """With compiling on, the tiled runner compiles attention_block and mlp_block separately (and the
    recomputes, which stop before the down projection: the layer's and the MLP chunk's; and a sparse
    layer's forward, which the mixture-of-experts layers run whole)."""
    wrapped = []
    LayerRunner(128, wrap=lambda fn: wrapped.append(fn.__name__) or fn)
    assert wrapped == ["decoder_layer", "layer_to_down", "attention_block", "mlp_block", "mlp_activation",
                       "routed_layer"]


def _hf_llama():
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
                                      attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(hf_cfg).float(), hf_cfg


def test_packed_documents_match_each_document_run_alone_through_hf():
    """Three documents packed into one 128-token sequence (with padding as a fourth, untrained one):
    per-token losses of the packed run with the document mask and per-document positions equal those
    of each document run alone through HF transformers, and so do the gradients of the summed loss."""
    model, hf_cfg = _hf_llama()
    cfg = ModelConfig.from_hf_dict({**hf_cfg.to_dict(), "model_type": "llama"})
    docs = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)) for n in (37, 50, 29)]
    s = 128
    tokens = torch.cat(docs).numpy()
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
    ids, labels, pos = (torch.from_numpy(a)[None] for a in packed_row(
        tokens, None, starts, np.array([len(d) for d in docs]), np.arange(3), s, 0))
    assert pos[0, 37] == 0 and pos[0, 36] == 36 and labels[0, 36] == DATA_IGNORE == M.IGNORE_INDEX

    # ours, packed: the model's pure functions on HF's weights
    sd = {k: v.detach().clone().requires_grad_(True) for k, v in model.state_dict().items()}
    units = {u: {n: sd[M.hf_name(u, n)] for n, _ in M.unit_params(cfg, u)} for u in M.unit_names(cfg)}
    rope, mask = step_contexts(cfg, pos[None], 1, s, torch.device("cpu"), torch.float32)[0]
    assert mask.shape == (1, 1, s, s) and not mask[0, 0, 40, 36] and mask[0, 0, 40, 37]
    x = M.embed(units["embed"], ids)
    for i in range(cfg.num_hidden_layers):
        x = M.decoder_layer(units[f"layers.{i}"], x, rope, cfg, mask)
    logits = torch.nn.functional.linear(M.final_norm(units["head"], x, cfg), units["head"]["lm_head.weight"])
    ours = torch.nn.functional.cross_entropy(logits[0].float(), labels[0], ignore_index=M.IGNORE_INDEX,
                                             reduction="none")
    ours.sum().backward()

    # HF, one document at a time
    want = torch.zeros(s)
    at = 0
    for d in docs:
        out = model(d[None]).logits[0]
        per_token = torch.nn.functional.cross_entropy(out[:-1], d[1:], reduction="none")
        per_token.sum().backward()
        want[at:at + len(d) - 1] = per_token.detach()
        at += len(d)
    _close(ours.detach(), want)
    assert (ours[labels[0] == M.IGNORE_INDEX] == 0).all()
    for name, p in model.named_parameters():
        _close(sd[name].grad, p.grad)


def test_packed_step_loss_through_the_pipeline_matches_per_document_reference(shm_dir, tmp_path):
    """The compute worker end to end (single-process driver, fp32 CPU) on packed text with
    data.pack_documents and a tiled MLP: step 0's loss equals the mean over the batch's documents,
    each run alone through HF transformers; later steps train (the loss falls)."""
    from megatrain_ray.data.loader import source_from_config
    from megatrain_ray.io.hf_io import load_train_config
    from megatrain_ray.orchestration.local import train_local

    model, _ = _hf_llama()
    model.save_pretrained(tmp_path / "hf")
    import pyarrow as pa

    corpus = tmp_path / "docs.arrow"  # pre-tokenized documents: prepared without Ray Data
    rng = np.random.default_rng(0)
    docs = [(int(rng.integers(0, 95)) + np.arange(int(rng.integers(5, 70)))) % 95 + 1 for _ in range(60)]  # counting
    table = pa.table({"input_ids": [d.tolist() for d in docs]})
    with pa.ipc.new_file(str(corpus), table.schema) as writer:
        writer.write_table(table)
    cfg = load_train_config(None, [
        f"train.init_from={tmp_path / 'hf'}", f"data.path={corpus}", "data.format=tokens", "data.pack_documents=true",
        "train.seq_len=96", "train.micro_batch_size=2", "train.num_micro_batches=2", "train.steps=6",
        "optim.lr=1e-2", "compute.device=cpu", "memory.mlp_chunk_size=40", "memory.loss_chunk_size=50",
        f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path / 'runs'}", "train.save_final=false",
        "train.checkpoint_every=0"])
    batch = source_from_config(cfg).batch(0)
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels, pos in zip(*(np.asarray(batch[k]).reshape(-1, 96) for k in ("input_ids", "labels",
                                                                                   "position_ids"))):
            bounds = [*np.flatnonzero(pos == 0), 96]
            for a, b in zip(bounds[:-1], bounds[1:]):
                logits = model(torch.from_numpy(ids[a:b])[None]).logits[0]
                lab = torch.from_numpy(labels[a:b])
                assert b == 96 or lab[-1] == M.IGNORE_INDEX  # nothing across a boundary
                total += float(torch.nn.functional.cross_entropy(logits, lab, ignore_index=M.IGNORE_INDEX,
                                                                 reduction="sum"))
                count += int((lab != M.IGNORE_INDEX).sum())
    losses = [r["loss"] for r in train_local(cfg, 0)]
    assert losses[0] == pytest.approx(total / count, rel=1e-5)
    assert losses[-1] < losses[0]


def test_loader_positions_and_labels_of_packed_windows():
    """Windows of an EOS-separated stream: positions restart after each EOS (a document cut by the
    window's start counts from 0), and the label that would cross into the next document is ignored."""
    eos = 9
    stream = np.array([1, 2, eos, 3, 4, 5, eos, 6, 7, eos, 8])
    starts = eos_starts(stream, eos)
    assert starts.tolist() == [0, 3, 7, 10]
    pos, ends = document_positions(starts, 1, 8)  # inputs stream[1:9] = 2 eos 3 4 5 eos 6 7
    assert pos.tolist() == [0, 1, 0, 1, 2, 3, 0, 1]
    assert ends.tolist() == [False, True, False, False, False, True, False, False]
    # next fit into 8 tokens: 5 + 3; 4 (9 would not fit); 9 cut to 8, alone; 2
    assert [b.tolist() for b in pack_rows(np.array([5, 3, 4, 9, 2]), 8)] == [[0, 1], [2], [3], [4]]


def test_packed_sft_rows_keep_each_example_whole_with_its_targets():
    tokens = np.arange(100, 120)
    mask = np.zeros(20, np.uint8)
    mask[2:5] = 1  # example 0 (tokens 0..4): responses are its last three
    mask[7:9] = 1  # example 1 (tokens 5..8)
    starts, lengths = np.array([0, 5, 9]), np.array([5, 4, 11])
    bins = pack_rows(lengths, 10)
    assert [b.tolist() for b in bins] == [[0, 1], [2]]
    ids, labels, pos = packed_row(tokens, mask, starts, lengths, bins[0], 10, 0)
    assert ids.tolist() == [100, 101, 102, 103, 104, 105, 106, 107, 108, 0]
    assert pos.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0]
    I = DATA_IGNORE
    assert labels.tolist() == [I, 102, 103, 104, I, I, 107, 108, I, I]
    ids, labels, pos = packed_row(tokens, mask, starts, lengths, bins[1], 10, 0)  # 11 tokens cut to 10
    assert ids.tolist() == list(range(109, 119)) and pos.tolist() == list(range(10))


def test_cpu_mask_is_dense_and_settings_are_validated(tmp_path):
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    m = attention_mask(pos)
    assert m.dtype == torch.bool and m[0, 0].tolist() == [
        [True, False, False, False, False], [True, True, False, False, False], [True, True, True, False, False],
        [False, False, False, True, False], [False, False, False, True, True]]
    with pytest.raises(ConfigError, match="memory.mlp_chunk_size"):
        load_config(None, ["memory.mlp_chunk_size=-1"])
    mem = load_config(None, []).memory
    assert mem.mlp_chunk_size_for(65536) == 0 and mem.mlp_chunk_size_for(131072) == 16384
    assert load_config(None, ["memory.mlp_chunk_size=0"]).memory.mlp_chunk_size_for(10**6) == 0


def test_pack_documents_refuses_a_stream_without_boundaries(tmp_path):
    from megatrain_ray.data.loader import BatchSource
    from megatrain_ray.errors import DataError

    path = tmp_path / "t.npy"
    np.save(path, np.arange(1000) % 50)
    with pytest.raises(DataError, match="data.pack_documents needs document boundaries"):
        BatchSource(str(path), 16, 1, 1, 0, 64, pack_documents=True)


def test_plan_prints_the_longest_context_that_fits_the_device_and_tiling_lengthens_it():
    """The 7B shape at 4 layers on a 139.8 GiB GPU with unlimited host: the longest context is the
    last multiple of 1024 tokens whose device peak fits 90% of the GPU; without MLP tiling it is
    shorter (the [S, intermediate] tensors), and the table says it."""
    import dataclasses

    from megatrain_ray.orchestration import preflight as P

    shape = ["model.hidden_size=3584", "model.intermediate_size=18944", "model.num_attention_heads=28",
             "model.num_key_value_heads=4", "model.vocab_size=152064", "model.model_type=qwen2",
             "model.num_hidden_layers=4", "train.seq_len=131072", "model.max_position_embeddings=131072",
             "train.micro_batch_size=1", "train.num_micro_batches=1", "memory.activations=offload"]
    gpu = int(139.8 * 2**30)
    found = {}
    for tiling in ("null", "0"):
        cfg = load_config(None, shape + [f"memory.mlp_chunk_size={tiling}"])
        plan = P.memory_plan(cfg, "cuda", device_bytes=gpu, starts_ray=False)
        plan.host_available = 2**50
        longest = found[tiling] = P.longest_context(cfg, "cuda", plan)

        def peak(s):
            c = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=s))
            return P.device_total(P.device_rows(c, "cuda", 1))

        assert longest % 1024 == 0 and peak(longest) <= gpu * P.GPU_USABLE < peak(longest + 1024)
        assert plan.context_limit == "GPU memory"
    assert found["null"] > 2 * found["0"] > 0 and found["null"] > 524288
    plan.longest_context = 1234
    assert "longest context that fits: 1,234 tokens per sequence at micro-batch 1 (longer ones exceed the GPU " \
           "memory)" in plan.table()
    plan.host_available = 2**30  # not even the store: no context fits, and the host is why
    assert P.longest_context(cfg, "cuda", plan) == 0 and plan.context_limit == "host RAM"
    plan.longest_context = 0
    assert "longest context that fits: none (even 1,024 tokens per sequence exceed the host RAM)" in plan.table()
    # Memory beyond the model's positions: the table offers max_position_embeddings, and says what memory allows.
    plan.longest_context, plan.max_positions = 558_080, 2048
    assert ("longest context that fits: 2,048 tokens per sequence, the model's model.max_position_embeddings (its "
            "memory at micro-batch 1 would allow 558,080: raise max_position_embeddings, with RoPE scaling, to use "
            "it)") in plan.table()


def test_sft_rows_are_packed_whole_by_the_loader(tmp_path):
    """Pre-tokenized examples with labels (rows layout) and data.pack_documents: each sequence holds
    whole examples in corpus order, positions restart per example, only targets are labels, and
    with packing off the same data stays one padded example per sequence."""
    import pyarrow as pa

    from megatrain_ray.data.loader import source_from_config

    examples = [list(range(1, 1 + n)) for n in (5, 4, 7, 3)]
    labels = [[-100, -100] + e[2:] for e in examples]  # the first two tokens are the prompt
    path = tmp_path / "sft.arrow"
    table = pa.table({"input_ids": examples, "labels": labels})
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)
    common = [f"data.path={path}", "data.format=tokens", "train.seq_len=10", "train.micro_batch_size=1",
              "train.num_micro_batches=1", "model.vocab_size=64", f"train.run_dir={tmp_path / 'runs'}"]
    packed = source_from_config(load_config(None, common + ["data.pack_documents=true"]))
    assert packed.num_samples == 2  # [5 + 4] and [7 + 3]
    rows = packed.samples(np.arange(2))
    I = DATA_IGNORE
    assert rows["input_ids"][0].tolist() == [1, 2, 3, 4, 5, 1, 2, 3, 4, 0]
    assert rows["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0]
    assert rows["labels"][0].tolist() == [I, 3, 4, 5, I, I, 3, 4, I, I]
    assert rows["input_ids"][1].tolist() == [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    assert rows["labels"][1].tolist() == [I, 3, 4, 5, 6, 7, I, I, 3, I]
    plain = source_from_config(load_config(None, common))
    assert plain.num_samples == 4 and "position_ids" not in plain.samples(np.arange(1))
    state = packed.state(1)
    with pytest.raises(Exception, match="pack_documents"):
        plain.resume_step(state)
