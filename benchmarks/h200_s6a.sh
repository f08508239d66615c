#!/usr/bin/env bash
# Session 6, first device call (nvidia-h200: 1x H200, 16 cores, 128 GiB), after merging the
# session-5 branches: every GPU test (GPU path, activation placement, compact state, embedding
# gradient), then the 7B benchmark with the defaults a user gets (activations placed by the
# planner: kept graphs where they fit) and the layer/AdamW probe.
#   bash benchmarks/h200_s6a.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
stamp "gpu tests"
timeout 270 python3 -m pytest -q -rs -p no:cacheprovider --durations=15 tests/test_gpu.py tests/test_gpu_actplace.py \
  tests/test_gpu_compact.py tests/test_embed_grad.py > "$out/log_gpu_tests.txt" 2>&1
echo "rc=$?" >> "$out/log_gpu_tests.txt"
grep -E "passed|failed|^FAILED|^ERROR|rc=" "$out/log_gpu_tests.txt" | tail -12
stamp "7b defaults (auto activations) + probe"
left=$(( 585 - ($(date +%s) - t0) ))
timeout $left python3 -m megatrain_ray.bench --preset 7b --steps 5 --probe --tag 7b-auto --out "$out" \
  > "$out/log_7b_auto.txt" 2>&1; echo "rc=$?" >> "$out/log_7b_auto.txt"
grep -E "^megatrain_ray|activations|^note|rc=|Error" "$out/log_7b_auto.txt" | cut -c1-300 | tail -8
stamp done
