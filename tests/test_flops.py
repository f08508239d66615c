"""The two FLOPs conventions (megatrain_ray.model.flops), counted by hand on small shapes, and the
plot reading metrics.jsonl files of either age. No Ray."""

import json

import pytest

from megatrain_ray.config import ModelConfig
from megatrain_ray.model import flops
from megatrain_ray.model.layout import StoreLayout


@pytest.mark.parametrize("tied", [False, True])
def test_both_conventions_by_hand(tied):
    # hidden 64, 4 heads of 16, 2 kv heads, MLP 176, 3 layers, vocabulary 260, qwen2 biases
    m = ModelConfig(model_type="qwen2", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=176, num_hidden_layers=3, vocab_size=260, tie_word_embeddings=tied)
    q, kv = 64, 32
    layer_matmuls = 64 * q + 2 * 64 * kv + q * 64 + 3 * 64 * 176
    layer_rest = 2 * 64 + q + 2 * kv  # two norms, q/k/v biases
    everything = 3 * (layer_matmuls + layer_rest) + 260 * 64 * (1 if tied else 2) + 64  # + final norm
    assert flops.num_params(m) == everything == StoreLayout.build(m).num_params
    assert flops.matmul_params(m) == 3 * layer_matmuls + 260 * 64  # the LM head (the embedding when tied)
    tokens, seq = 1000, 128
    assert flops.flops_6nt(m, tokens) == 6 * everything * tokens
    attention = 12 * 3 * 4 * 16 * seq  # 12 L heads head_dim S, full S x S
    assert flops.attention_flops_per_token(m, seq) == attention
    assert flops.palm_model_flops(m, seq, tokens) == (6 * (3 * layer_matmuls + 260 * 64) + attention) * tokens
    rates = flops.tflops(m, seq, tokens, 0.5)
    assert rates == {"tflops_6nt": pytest.approx(6 * everything * tokens / 0.5 / 1e12),
                     "tflops_palm": pytest.approx(flops.palm_model_flops(m, seq, tokens) / 0.5 / 1e12)}
    assert set(rates) == set(flops.TFLOPS_KEYS.values())


def test_plot_reads_both_conventions_and_the_old_key(tmp_path):
    """New rows carry tflops_6nt and tflops_palm, one right axis each; rows written before carry one
    model_tflops, which was PaLM's: read as PaLM's, with no 6NT axis."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from megatrain_ray.plot import figures, tflops

    assert tflops({"model_tflops": 2.0}, "tflops_palm") == 2.0 and tflops({"model_tflops": 2.0}, "tflops_6nt") is None
    assert tflops({"tflops_palm": 3.0, "model_tflops": 2.0}, "tflops_palm") == 3.0
    m = ModelConfig()
    for name, extra in (("new", lambda s: flops.tflops(m, 64, 1024, s)),
                        ("old", lambda s: {"model_tflops": flops.tflops(m, 64, 1024, s)["tflops_palm"]})):
        run = tmp_path / name
        run.mkdir()
        with open(run / "metrics.jsonl", "w") as f:
            for step in range(3):
                row = {"step": step, "loss": 5.0, "lr": 1e-3, "tokens": 1024, "step_s": 0.1 * (step + 1), "compute_busy_s": 0.05}
                f.write(json.dumps({**row, **extra(row["step_s"])}) + "\n")
        figs = figures(str(run))
        try:
            ax = figs["throughput.png"].axes[0]
            labels = sorted(c.get_ylabel() for c in ax.child_axes)
            want = ["TFLOP/s (6·N·T)", "TFLOP/s (PaLM: matmuls + attention)"] if name == "new" else [
                "TFLOP/s (PaLM: matmuls + attention)"]
            assert labels == want
            (line,) = ax.get_lines()
            per_token = flops.palm_model_flops(m, 64, 1024) / 1024
            assert f"PaLM {per_token:.3g} FLOPs/token" in line.get_label()
            assert ("6·N·T" in line.get_label()) == (name == "new")
        finally:
            for fig in figs.values():
                plt.close(fig)
