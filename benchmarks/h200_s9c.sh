#!/usr/bin/env bash
# Session 9, call 3 on nvidia-h200: the new defaults against the compiled GPU-resident baseline in
# one run (issue 16's yardstick), after the GPU tests. New since call 2: the recompute of a
# checkpointed layer stops before its down projection (engine/sequence.py), runtime.device_adamw
# defaults to auto (edges+1 on this GPU), the plan uses 94% of the GPU.
#   bash benchmarks/h200_s9c.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 200 python3 -m pytest -q -x tests/test_gpu.py > "$out/log_gpu.txt" 2>&1
echo "rc=$?" >> "$out/log_gpu.txt"; tail -2 "$out/log_gpu.txt"
echo "[$(( SECONDS - t0 )) s] bench"
timeout $(( 575 - (SECONDS - t0) )) python3 -m megatrain_ray.bench --preset 7b --steps 6 --baseline-compiled \
  --tag 7b-final --out "$out" > "$out/log_7b-final.txt" 2>&1; echo "rc=$?" >> "$out/log_7b-final.txt"
grep -vE "^20[0-9-]+ |Warning|warn" "$out/log_7b-final.txt" | tail -22 | cut -c1-260
