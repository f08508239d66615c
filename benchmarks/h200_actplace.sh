#!/usr/bin/env bash
# Activation placement on nvidia-h200 (1x H200, 16 cores, 128 GiB): the 7B shape (Qwen2.5-7B, 28
# layers), 65,536 tokens per step in 4 micro-batches, 5 steps, side by side in one device call:
#   1. 7b-recompute: runtime.activations=recompute (every layer recomputed: the behaviour before);
#   2. 7b-auto: the new default (the planner keeps as many layers' graphs whole as the free GPU
#      memory holds), with --probe: the layer probe times a kept layer against a recomputed one,
#      measures the bytes per token a kept graph holds (eager and compiled, against the planner's
#      formula) and the eager layer under each SDPA backend (flash / cudnn / efficient / math).
# Prints s/step, TFLOPS (6·N·T and PaLM's) and GPU peak for each, then the probe's figures.
#   bash benchmarks/h200_actplace.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=$PWD/build/torch_extensions
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
b="python3 -m megatrain_ray.bench --preset 7b --tokens 65536 --seq-len 1024 --micro-batches 4 --steps 5 --out $out"
run() {  # run TAG TIMEOUT ARGS...
  local tag=$1 limit=$2; shift 2
  stamp "$tag"
  timeout "$limit" $b --tag "$tag" "$@" > "$out/log_$tag.txt" 2>&1; echo "rc=$?" >> "$out/log_$tag.txt"
  grep -E "^megatrain_ray|^error|Error|^rc=" "$out/log_$tag.txt" | tail -3
}
python3 -m megatrain_ray.cli plan --device cuda --set model.model_type=qwen2 --set model.num_hidden_layers=28 \
  --set model.hidden_size=3584 --set model.intermediate_size=18944 --set model.num_attention_heads=28 \
  --set model.num_key_value_heads=4 --set model.vocab_size=152064 --set model.rope_theta=1e6 \
  --set train.seq_len=1024 --set train.micro_batch_size=16 --set train.num_micro_batches=4 > "$out/plan_7b.txt" 2>&1
grep -E "^activation|^total GPU" "$out/plan_7b.txt"
run 7b-recompute 170 --set runtime.activations=recompute
run 7b-auto 250 --probe
stamp done
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
print(f"{'run':<14}{'s/step':>8}{'TF 6NT':>8}{'TF PaLM':>9}{'GPU GiB':>9}")
for tag in ("7b-recompute", "7b-auto"):
    path = os.path.join(out, f"bench-{tag}.json")
    if not os.path.exists(path):
        print(f"{tag:<14}  (no result: see log_{tag}.txt)")
        continue
    r = json.load(open(path))["systems"]["megatrain_ray"]
    print(f"{tag:<14}{r['step_s']:>8.3f}{r['tflops_6nt']:>8.1f}{r['tflops_palm']:>9.1f}{r['device_peak_gib']:>9.1f}")
path = os.path.join(out, "bench-7b-auto.json")
if os.path.exists(path) and "layer_probe" in json.load(open(path)):
    p = json.load(open(path))["layer_probe"]
    keys = [k for k in p if k.startswith(("fwd_", "bwd_", "kept_"))]
    print("layer probe (ms per layer, 4 micro-batches; bytes per token):")
    for k in keys:
        print(f"  {k:<34}{p[k]:>12.2f}")
PY
