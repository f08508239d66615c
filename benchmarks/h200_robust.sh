#!/usr/bin/env bash
# Issue 14 on the GPU (nvidia-h200: 1x H200): the deterministic embedding gradient.
# 1. tests/test_embed_grad.py: CPU equality with index_add_; on the GPU the same bits on every run
#    (under torch.use_deterministic_algorithms) and 3 steps + checkpoint + resume + 3 steps equal to
#    6 straight steps bit for bit through the real Ray pipeline.
# 2. benchmarks/embed_grad_bench.py: cost of the fixed order against index_add_ at 7B-like shapes.
#   bash benchmarks/h200_robust.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
stamp "gpu tests"
timeout 400 python3 -m pytest -q -rs tests/test_embed_grad.py > "$out/log_embed_grad_tests.txt" 2>&1
echo "rc=$?" >> "$out/log_embed_grad_tests.txt"
grep -E "passed|failed|SKIPPED|Error|differ|rc=" "$out/log_embed_grad_tests.txt" | tail -8
stamp "embedding backward cost"
timeout 150 python3 benchmarks/embed_grad_bench.py "$out" > "$out/log_embed_grad_bench.txt" 2>&1
echo "rc=$?" >> "$out/log_embed_grad_bench.txt"
tail -5 "$out/log_embed_grad_bench.txt"
stamp done
