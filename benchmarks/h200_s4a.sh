#!/usr/bin/env bash
# Session 4, first device call (nvidia-h200: 1x H200, 16 cores, 128 GiB): issue 19.
# The GPU tests (one step against the resident model; 24 steps under Ray against the resident run,
# bf16 and fp32 gradients), then the convergence benchmark on package text (Qwen2.5-0.5B shape,
# 300 steps: megatrain_ray with bf16 and fp32 gradients, and GPU-resident PyTorch).
#   bash benchmarks/h200_s4a.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
stamp "gpu tests"
timeout 220 python3 -m pytest -q -s tests/test_gpu.py tests/test_gpu_training.py > "$out/log_gpu_tests.txt" 2>&1
echo "rc=$?" >> "$out/log_gpu_tests.txt"
grep -E "grad_dtype=|passed|failed|Error|rc=" "$out/log_gpu_tests.txt" | tail -8
stamp "convergence"
CONVERGENCE_WORK=/tmp/conv timeout 350 python3 benchmarks/convergence.py --steps 300 --out "$out/conv" \
  > "$out/log_convergence.txt" 2>&1
echo "rc=$?" >> "$out/log_convergence.txt"
grep -vE "^\(|^step |INFO|WARNING" "$out/log_convergence.txt" | tail -14
stamp done
