"""A mixture of experts' load as the run reports it (megatrain_ray.orchestration.expert_load): the
imbalance and idle experts per sparse layer in the metrics row, the step line's summary, and
``plot``'s experts.png (layer axis named by decoder layer, idle experts marked), from written rows.
(tests/test_configs.py checks the same fields and line from a real tiny-moe run.)"""

import json

import pytest

from megatrain_ray.config import load_config
from megatrain_ray.orchestration import expert_load

TOKENS = [[[4, 0, 2, 2], [2, 2, 2, 2]],  # step 1: layer 1 has an idle expert, layer 3 is balanced
          [[3, 0, 3, 2], [1, 3, 4, 0]]]  # step 2: expert 1 of layer 1 never gets a token


def test_fields_and_the_step_line():
    row = {"step": 1, "expert_tokens": TOKENS[0], **expert_load.fields([1, 3], TOKENS[0])}
    assert row["expert_layers"] == [1, 3]
    assert row["expert_imbalance"] == [2.0, 1.0] and row["expert_idle"] == [[1], []]
    assert expert_load.summary(row) == " | experts: imbalance 2.00 (layer 1), idle 1 (layer 1: 1)"
    balanced = {"expert_tokens": [[2, 2]], **expert_load.fields([0], [[2, 2]])}
    assert expert_load.summary(balanced) == " | experts: imbalance 1.00 (layer 0), none idle"
    many = expert_load.fields([1, 2], [[0] * 7 + [9], [0, 5]])
    assert expert_load.summary(many) == " | experts: imbalance 8.00 (layer 1), idle 8 (layer 1: 0, 1, 2, 3, 4, 5, ...)"
    assert expert_load.fields([1], None) == {} and expert_load.summary({"loss": 1.0}) == ""


@pytest.mark.parametrize("with_layers", [True, False])
def test_experts_png_names_the_sparse_layers_and_marks_idle_experts(tmp_path, with_layers):
    """Rows that carry expert_layers, and rows written before they did (the layers then come from the
    run's config.json): the layer axis reads 1 and 3 at the heatmap's rows, not -0.5 ... 1.5 or 0, 1."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from megatrain_ray.plot import figures

    model = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 4, "num_experts_per_tok": 2,
             "decoder_sparse_step": 2, "vocab_size": 260, "hidden_size": 64, "intermediate_size": 176,
             "num_attention_heads": 4, "num_key_value_heads": 2}
    cfg = load_config(None, [f"model.{k}={v}" for k, v in model.items()])
    assert cfg.model.sparse_layers == (1, 3)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step, tokens in enumerate(TOKENS, 1):
            extra = expert_load.fields(cfg.model.sparse_layers, tokens) if with_layers else {}
            f.write(json.dumps({"step": step, "loss": 1.0, "lr": 1e-3, "step_s": 1.0, "tokens": 16,
                                "tokens_per_s": 16.0, "compute_busy_s": 0.5, "expert_tokens": tokens,
                                **extra}) + "\n")
    figs = figures(str(tmp_path))
    try:
        heat, line = figs["experts.png"].axes[:2]
        assert list(heat.get_yticks()) == [0, 1]
        assert [t.get_text() for t in heat.get_yticklabels()] == ["1", "3"]
        assert list(heat.get_xticks()) == [0, 1, 2, 3]
        (marks,) = heat.collections  # expert 1 of the first sparse layer: no token in the whole run
        assert marks.get_offsets().tolist() == [[1.0, 0.0]]
        idle_axis = figs["experts.png"].axes[-1]
        assert list(idle_axis.get_lines()[0].get_ydata()) == [1, 2]  # idle experts per step, all layers
    finally:
        for fig in figs.values():
            plt.close(fig)
