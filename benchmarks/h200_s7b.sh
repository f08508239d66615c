#!/usr/bin/env bash
# Session 7, issue 11's "defaults as fast as the benchmark" on a shape that is no preset: the
# Mistral-7B shape (vocab 32,000, 32 layers, hidden 4096, MLP 14336, 32/8 heads), 65,536 tokens per
# step, trained with `megatrain-ray train --config` and the library's defaults, against
# `megatrain-ray bench --config` on the same config, in one call on nvidia-h200; then the GPU
# placement tests (kept graphs vs recompute on the GPU).
#   bash benchmarks/h200_s7b.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
work=/tmp/m7; mkdir -p "$work"
python3 -c "import numpy as np; np.save('$work/tokens.npy', np.random.default_rng(0).integers(0, 32000, size=4_000_000))"
cat > "$work/mistral7b.yaml" <<YAML
model:
  model_type: mistral
  vocab_size: 32000
  hidden_size: 4096
  intermediate_size: 14336
  num_hidden_layers: 32
  num_attention_heads: 32
  num_key_value_heads: 8
  max_position_embeddings: 32768
  rope_theta: 1000000.0
  rms_norm_eps: 1.0e-5
  tie_word_embeddings: false
optim: {lr: 1.0e-4, weight_decay: 0.1, warmup_steps: 0, max_grad_norm: 1.0}
train: {steps: 6, seq_len: 1024, micro_batch_size: 16, num_micro_batches: 4, checkpoint_every: 0, save_final: false}
data: {path: $work/tokens.npy}
runtime: {device: cuda, run_dir: $work/runs}
YAML
stamp "bench --config (at most 250 s)"
timeout 250 python3 -m megatrain_ray.bench --config "$work/mistral7b.yaml" --steps 6 --tag m7-bench --out "$out" \
  > "$out/log_m7_bench.txt" 2>&1; echo "rc=$?" >> "$out/log_m7_bench.txt"
grep -E "^megatrain_ray|activations|rc=|Error" "$out/log_m7_bench.txt" | cut -c1-300 | tail -4
stamp "train --config (at most 250 s)"
timeout 250 python3 -m megatrain_ray.cli train --config "$work/mistral7b.yaml" > "$out/log_m7_train.txt" 2>&1
echo "rc=$?" >> "$out/log_m7_train.txt"
grep -E "activations|step +6|rc=|Error" "$out/log_m7_train.txt" | cut -c1-300 | tail -4
cp "$(ls -d $work/runs/*/ | head -1)metrics.jsonl" "$out/m7_train_metrics.jsonl" 2>/dev/null
stamp "GPU placement tests"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_actplace.py > "$out/log_gpu_actplace.txt" 2>&1
echo "rc=$?" >> "$out/log_gpu_actplace.txt"; tail -3 "$out/log_gpu_actplace.txt"
stamp done
python3 - "$out" <<'PY'
import json, os, statistics, sys
out = sys.argv[1]
bench = os.path.join(out, "bench-m7-bench.json")
b = json.load(open(bench))["systems"]["megatrain_ray"]["step_s"] if os.path.exists(bench) else None
path = os.path.join(out, "m7_train_metrics.jsonl")
rows = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
ends = [r["elapsed_s"] for r in rows if "elapsed_s" in r]
periods = [q - p for p, q in zip(ends, ends[1:])][1:]  # as the bench: after 2 warm-up steps
t = statistics.median(periods) if periods else None
print(f"Mistral-7B shape, 65,536 tokens/step: bench {b if b is None else round(b, 3)} s/step, "
      f"train --config {t if t is None else round(t, 3)} s/step (periods {[round(p, 3) for p in periods]})")
if b and t:
    print(f"train's tokens/s = {b / t:.3f} x the bench's (issue 11 asks >= 0.95)")
PY
