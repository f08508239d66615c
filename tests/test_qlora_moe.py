"""LoRA over an MXFP4 base (lora.base_format mxfp4) through the real pipeline, against transformers + peft +
torch.optim.AdamW on the dequantized base.

Two tiny mixtures of experts with 16 experts each (tests/test_lora_moe.py's): gpt-oss, saved as the
Hub's MXFP4 checkpoint (its experts quantized by torchao into ``*_blocks`` / ``*_scales``), which our
store takes as it is; and Qwen3-MoE, saved in fp32, which our store quantizes at load. Ours trains
adapters on the attention and on every routed expert, in fp32 on the CPU, the experts' weights
streamed as MXFP4 and dequantized before each layer's pass. The reference is peft on transformers'
model whose experts are transformers' own dequantization (``convert_moe_packed_tensors``) of
torchao's MXFP4 of them; the store's dequantized weights are those, bit for bit
(tests/test_quant_mxfp4.py), so the training is the same math on the same base, and as in
tests/test_qlora.py the float64 truth is transformers + peft on that dequantized model, the second
fp32 reference the same with eager attention and experts and the micro-batches reversed, and ours
must be as close to the truth as tests/float64_truth.py says. The quantization matters: the base
before quantization gives another first loss.

The merged export (final/) is the adapters merged into the dequantized base, loaded by transformers
(no quantization_config), equal to peft's own merge; the adapter directory loads with
``PeftModel.from_pretrained`` on the dequantized model and gives final/'s logits; what no adapter
touches is the checkpoint's as it was (the attention's frozen parts, routers, norms: raw).
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")

from artifacts import parity_run  # noqa: E402
from float64_truth import assert_as_close_to_truth, float64_only, to_float64  # noqa: E402
from test_lora_moe import _model, _peft, _reference  # noqa: E402
from test_quant_mxfp4 import _mxfp4_checkpoint, mx_round_trip  # noqa: E402

from megatrain_ray.data.loader import BatchSource  # noqa: E402
from megatrain_ray.io.hf_io import load_train_config  # noqa: E402
from megatrain_ray.model.layout import StoreLayout  # noqa: E402
from megatrain_ray.model.quant_layout import QuantLayout  # noqa: E402
from megatrain_ray.orchestration.pipeline import train  # noqa: E402

STEPS = 4


def _dequantized(arch: str, aux: bool, **kw):
    """The tiny model with each sparse layer's experts replaced by transformers' dequantization of torchao's MXFP4."""
    model = _model(arch, aux, **kw)
    with torch.no_grad():
        for layer in model.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            for proj in ("gate_up_proj", "down_proj") if experts is not None else ():
                p = getattr(experts, proj)
                rows_last = arch == "gpt_oss"  # gpt-oss's [E, in, out]; the others' [E, out, in]
                w = p.transpose(1, 2) if rows_last else p
                q = mx_round_trip(w.detach())
                p.copy_(q.transpose(1, 2) if rows_last else q)
    return model


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_moe"])
def test_lora_over_an_mxfp4_base_matches_peft_and_adamw(arch, ray_cluster, shm_dir, tmp_path):
    aux = True
    if arch == "gpt_oss":  # the Hub's MXFP4 form, read as it is
        _mxfp4_checkpoint(_model(arch, aux), tmp_path / "init")
    else:  # fp32, quantized at load
        _model(arch, aux).save_pretrained(tmp_path / "init")
    cfg = load_train_config(None, [*parity_run(tmp_path, shm_dir, STEPS), "train.seq_len=8", "train.micro_batch_size=1",
                                   "train.num_micro_batches=2", "optim.warmup_steps=1", "optim.lr=2e-2",
                                   "optim.max_grad_norm=0.05", "lora.rank=4", "lora.alpha=8",
                                   "lora.target_modules=q_proj,k_proj,v_proj,o_proj", "lora.base_format=mxfp4"])
    assert cfg.model.model_type == arch and cfg.lora.target_experts == ("gate_up_proj", "down_proj")
    result = train(cfg, log=lambda line: None)
    run = tmp_path / "runs" / result.run_id

    source = BatchSource(cfg.data.path, cfg.train.seq_len, cfg.train.micro_batch_size,
                         cfg.train.num_micro_batches, cfg.train.seed, cfg.model.vocab_size)
    ref_losses, ref, ref_routed = _reference(_peft(_dequantized(arch, aux), cfg), cfg, source)
    alt_losses, alt, _ = _reference(_peft(_dequantized(arch, aux, attention="eager", experts="eager"), cfg), cfg,
                                    source, reverse=True)
    exact = _peft(to_float64(_dequantized(arch, aux, experts="eager")), cfg, double=True)
    with float64_only():
        true_losses, truth, _ = _reference(exact, cfg, source)
    plain_losses, _, _ = _reference(_peft(_model(arch, aux), cfg), cfg, source)

    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["expert_tokens"] for r in rows] == ref_routed  # the same routing as transformers', step by step
    assert abs(plain_losses[0] - true_losses[0]) > 1e-4  # the quantization matters (fp32 rounding: ~1e-6 here)
    assert max(result.grad_norms) > cfg.optim.max_grad_norm  # clipping was active
    steps = [f"loss of step {i}" for i in range(STEPS)]
    assert_as_close_to_truth(dict(zip(steps, result.losses)), [dict(zip(steps, ref_losses)),
                             dict(zip(steps, alt_losses))], dict(zip(steps, true_losses)))
    from safetensors.torch import load_file
    ours = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert set(ours) == set(ref) and any(".experts." in k for k in ours)
    assert_as_close_to_truth(ours, [ref, alt], truth)

    # a sparse layer crosses the link as its bytes in the store (its experts MXFP4), a routed fetch as fewer
    sparse, layout = f"layers.{cfg.model.sparse_layers[0]}", StoreLayout.build(cfg.model)
    i = layout.units.index(sparse)
    nbytes = QuantLayout.build(cfg.model, "mxfp4", torch.float32).units[i].nbytes
    sent = [n for lane, label, _, _, n in result.timeline if lane == "h2d" and label == sparse]
    assert sent and max(sent) <= nbytes < 0.3 * 4 * layout.templates[i].numel

    # peft loads the adapters on the dequantized model and gives final/'s logits; final/ is peft's own merge
    final_dir = run / "final"
    assert "quantization_config" not in json.load(open(final_dir / "config.json"))
    loaded = peft.PeftModel.from_pretrained(_dequantized(arch, aux), str(run / "adapter")).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(final_dir)).eval()
    ids = torch.tensor(source.batch(0)["input_ids"][0])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, merged(input_ids=ids).logits.float(),
                                   rtol=1e-5, atol=1e-5)
    theirs = loaded.merge_and_unload().state_dict()
    stacked = merged.state_dict()
    assert set(stacked) == set(theirs)
    for key in stacked:
        torch.testing.assert_close(stacked[key], theirs[key], rtol=1e-6, atol=1e-6)
    base = _dequantized(arch, aux).state_dict()
    untouched = [k for k in stacked if ".experts." not in k and not any(f".{m}." in k for m in cfg.lora.target_modules)]
    assert untouched and all(torch.equal(stacked[k], base[k]) for k in untouched)
