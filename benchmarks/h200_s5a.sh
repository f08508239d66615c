#!/usr/bin/env bash
# Session 5, first device call (nvidia-h200: 1x H200, 16 cores, 128 GiB).
# Issue 19: what fp32 gradient transfer costs at the 7B shape (65,536 tokens/step), beside the
# default (bf16) in the same call; the default run also probes one layer (eager/compiled) and AdamW.
# Issues 15/16: which SDPA backend is fastest at the 7B heads, short and long sequences.
#   bash benchmarks/h200_s5a.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
stamp "attention backends"
timeout 150 python3 benchmarks/attn_probe.py --out "$out" > "$out/log_attn.txt" 2>&1; echo "rc=$?" >> "$out/log_attn.txt"
stamp "7b default (bf16 gradients)"
timeout 200 python3 -m megatrain_ray.bench --preset 7b --steps 5 --probe --tag 7b-bf16grad --out "$out" \
  > "$out/log_7b_bf16.txt" 2>&1; echo "rc=$?" >> "$out/log_7b_bf16.txt"
stamp "7b fp32 gradients"
timeout 200 python3 -m megatrain_ray.bench --preset 7b --steps 5 --set runtime.grad_dtype=float32 --tag 7b-fp32grad \
  --out "$out" > "$out/log_7b_fp32.txt" 2>&1; echo "rc=$?" >> "$out/log_7b_fp32.txt"
stamp done
for f in log_7b_bf16 log_7b_fp32; do echo "== $f"; grep -vE "^\(|INFO|WARNING|^ *$" "$out/$f.txt" | tail -14; done
echo "== attention"; tail -20 "$out/log_attn.txt"
