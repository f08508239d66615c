#!/usr/bin/env bash
# Session 4, second device call (nvidia-h200-x2: 2x H200, 32 cores, 256 GiB): issues 19 and 13.
# Phase 1, side by side: the GPU tests on GPU 0 (one step vs the resident model; 24 steps under Ray
# vs resident runs, bf16 and fp32 gradients) and, on GPU 1, the convergence run that call A could
# not finish (megatrain_ray with fp32 gradients, 300 steps; call A has the resident run and the bf16
# one on the same data). Phase 2: the 7B shape with 65,536 tokens per GPU per step on 1 and on 2
# GPUs in one bench run (weak scaling, the ratio printed).
#   bash benchmarks/h200x2_s4b.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
stamp "phase 1: gpu tests (GPU 0) | convergence, fp32 gradients (GPU 1)"
CUDA_VISIBLE_DEVICES=0 timeout 230 python3 -m pytest -q -s tests/test_gpu.py tests/test_gpu_training.py \
  > "$out/log_gpu_tests.txt" 2>&1 &
tests=$!
sleep 8
CUDA_VISIBLE_DEVICES=1 CONVERGENCE_WORK=/tmp/conv timeout 230 python3 benchmarks/convergence.py --steps 300 \
  --variants megatrain_ray_fp32_grads --out "$out/conv" > "$out/log_convergence_fp32.txt" 2>&1
echo "rc=$?" >> "$out/log_convergence_fp32.txt"
wait $tests; echo "rc=$?" >> "$out/log_gpu_tests.txt"
grep -E "grad_dtype=|passed|failed|rc=" "$out/log_gpu_tests.txt" | cut -c1-400 | tail -6
grep -E "final loss|rc=|Error" "$out/log_convergence_fp32.txt" | tail -4
stamp "phase 2: 7b on 1 and 2 GPUs"
timeout 330 python3 -m megatrain_ray.bench --preset 7b --steps 4 --gpus 1,2 --out "$out" --tag 7b-gpus12 \
  > "$out/log_7b-gpus12.txt" 2>&1; echo "rc=$?" >> "$out/log_7b-gpus12.txt"
grep -E "^system|^megatrain_ray|GPUs:|^ours|rc=|Error" "$out/log_7b-gpus12.txt" | cut -c1-300
stamp done
