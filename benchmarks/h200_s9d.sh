#!/usr/bin/env bash
# Session 9, call 4 on nvidia-h200: the GPU tests of whole runs under the new defaults
# (runtime.device_adamw=auto -> edges+1 on one GPU, the recompute without the down projection):
# 24 steps under Ray against the GPU-resident runs, and the activation placement on the GPU.
#   bash benchmarks/h200_s9d.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
timeout 330 python3 -m pytest -q -s tests/test_gpu_training.py tests/test_gpu_actplace.py > "$out/log_gpu_runs.txt" 2>&1
echo "rc=$?" >> "$out/log_gpu_runs.txt"; grep -E "ours vs|passed|failed|Error|rc=" "$out/log_gpu_runs.txt" | cut -c1-400 | tail -12
