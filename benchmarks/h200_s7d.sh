#!/usr/bin/env bash
# Session 7, fourth device call (nvidia-h200): the GPU tests after the lean partitioner and the
# compiled LM head (convergence against HF + torch AdamW, kept graphs, the head, compact state),
# then the 7B benchmark with 15 layers kept whole (runtime.activations=keep=15,host=0) against
# the planner's choice (13), to see what the head's smaller compiled peak would buy.
#   bash benchmarks/h200_s7d.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
stamp "GPU tests (at most 300 s)"
timeout 300 python3 -m pytest -q -rs -p no:cacheprovider --durations=10 -m "" tests/test_gpu.py tests/test_gpu_training.py \
  tests/test_gpu_actplace.py tests/test_gpu_compact.py tests/test_head.py > "$out/log_gpu_tests.txt" 2>&1
echo "rc=$?" >> "$out/log_gpu_tests.txt"; grep -E "passed|failed|FAILED|rc=" "$out/log_gpu_tests.txt" | tail -8
left=$(( 585 - ($(date +%s) - t0) )); (( left > 230 )) && left=230
if (( left > 150 )); then
  stamp "7b-keep15, at most $left s"
  timeout $left python3 -m megatrain_ray.bench --preset 7b --steps 6 --set runtime.activations=keep=15,host=0 \
    --tag 7b-keep15 --out "$out" > "$out/log_7b-keep15.txt" 2>&1; echo "rc=$?" >> "$out/log_7b-keep15.txt"
  grep -E "^megatrain_ray|activations|^note|rc=|Error" "$out/log_7b-keep15.txt" | cut -c1-300 | tail -5
else
  stamp "no time for the keep=15 bench"
fi
stamp done
