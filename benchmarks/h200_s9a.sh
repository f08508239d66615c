#!/usr/bin/env bash
# Session 9, call 1 on nvidia-h200: runtime.device_adamw on the GPU for the first time. The GPU
# training test of the owned units (edges against the GPU-resident runs), then the 7B bench with the
# embedding and head updated on the GPU (edges), with layer 0 too (edges+1), and the host update
# (the default), side by side. If the GPU test fails, only the default runs (and the layer probe).
#   bash benchmarks/h200_s9a.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
timeout 150 python3 -m pytest -q -x -s tests/test_gpu_training.py -k device_adamw > "$out/log_gpu_edges.txt" 2>&1
rc=$?; echo "rc=$rc" >> "$out/log_gpu_edges.txt"; grep -E "ours vs|passed|failed|Error|rc=" "$out/log_gpu_edges.txt" | cut -c1-300 | tail -8
export BUDGET=$(( 575 - ($(date +%s) - t0) ))
if (( rc == 0 )); then
  bash benchmarks/bench_side_by_side.sh "$out" "7b-edges1:--set runtime.device_adamw=edges+1" \
    "7b-edges:--set runtime.device_adamw=edges" "7b-host:"
else
  bash benchmarks/bench_side_by_side.sh "$out" "7b-host:--probe"
fi
