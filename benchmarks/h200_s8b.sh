#!/usr/bin/env bash
# Session 8 (written; not yet run). One call on nvidia-h200: the GPU tests of the owned units
# (runtime.device_adamw=edges against the GPU-resident runs, tests/test_gpu_training.py) and the rest
# of the GPU suite in the time left.
#   bash benchmarks/h200_s8b.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
timeout 280 python3 -m pytest -q -x -s tests/test_gpu_training.py > "$out/log_gpu_training.txt" 2>&1
echo "rc=$?" >> "$out/log_gpu_training.txt"; grep -E "ours vs|passed|failed|rc=" "$out/log_gpu_training.txt" | cut -c1-300
timeout 280 python3 -m pytest -q tests/test_gpu.py tests/test_gpu_actplace.py tests/test_head.py \
  > "$out/log_gpu_rest.txt" 2>&1; echo "rc=$?" >> "$out/log_gpu_rest.txt"; tail -3 "$out/log_gpu_rest.txt"
