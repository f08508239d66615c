#!/usr/bin/env bash
# Third device call of 2026-11-30 (session 2): megatrain_ray and the peers (DeepSpeed ZeRO-3
# offload, FSDP2 CPU offload) at the 3b shape, one table; then the Ray-vs-single-process check.
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out/peers"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=$PWD/build/torch_extensions
start=$SECONDS
timeout 120 python3 -m megatrain_ray.bench --preset 3b --steps 4 --out "$out/peers" 2>&1 | tail -6
sleep 5
timeout 420 python3 benchmarks/peers.py --preset 3b --systems deepspeed,fsdp2 --steps 3 --timeout-s 200 \
  --budget-s 400 --out "$out/peers" 2>&1 | tail -12
left=$((560 - (SECONDS - start)))
if [ $left -gt 75 ]; then
  sleep 3
  timeout $((left - 5)) python3 -m megatrain_ray.bench --preset 1b --steps 5 --single-process --out "$out" 2>&1 | tail -6
fi
