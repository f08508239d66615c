#!/usr/bin/env bash
# Session 3, first device call (nvidia-h200: 1x H200, 16 cores, 128 GiB): what issue 3 still lacked.
# GPU tests (offload cases included), GPU memory flat in depth with offloaded checkpoints (14 vs 28
# layers), 7B without clipping (updates overlap the backward), bf16 master without clipping at 44
# layers (11.3 B: the gradient ring, <= 10 B/param, and our largest size on this machine), 7B at
# 131,072 tokens/step with clipping (the forward outlasts the update).
#   bash benchmarks/h200_s3a.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
b="python3 -m megatrain_ray.bench --preset 7b --out $out"
run() {  # run TAG TIMEOUT ARGS...: one bench run, its log under $out, the summary lines printed
  local tag=$1 limit=$2; shift 2
  stamp "$tag"
  timeout "$limit" $b --tag "$tag" "$@" > "$out/log_$tag.txt" 2>&1; echo "rc=$?" >> "$out/log_$tag.txt"
  grep -E "^megatrain_ray|^ours, share|^rc=" "$out/log_$tag.txt"
}
stamp "gpu tests"
timeout 150 python3 -m pytest -q tests/test_gpu.py > "$out/log_gpu_tests.txt" 2>&1; tail -1 "$out/log_gpu_tests.txt"
run 7b-offload 130 --steps 3 --set runtime.offload_activations=true
run 7b-14-offload 90 --steps 3 --layers 14 --set runtime.offload_activations=true
run 7b-noclip 120 --steps 4 --max-grad-norm 0
run 7b-44-bf16-noclip 150 --steps 3 --layers 44 --master-dtype bfloat16 --max-grad-norm 0
run 7b-128k 150 --steps 3 --tokens 131072 --micro-batches 8
stamp done
