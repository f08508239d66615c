#!/usr/bin/env bash
# Session 3, last device call (nvidia-h200: 1x H200, 16 cores, 128 GiB), after the compile-worker
# fix (runtime.compile_threads=1: no Inductor worker pool, whose 16 processes took 6.3 GiB of host
# RAM in call A and pushed the offloaded 28-layer 7B run past Ray's memory monitor).
# 1. 7B, 28 layers, checkpoints offloaded (GPU peak vs the 14-layer run of call A: 24.4 GiB).
# 2. 7B default settings again: host memory as peak RSS + shm without the worker pool.
# 3. DeepSpeed ZeRO-3 offload at 20 and 24 layers of the 7B shape (16k tokens): its largest size here.
#   bash benchmarks/h200_s3c.sh $OUT [SECONDS]
set -uo pipefail
out=${1:-/tmp/out}; budget=${2:-480}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=$PWD/build/torch_extensions
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
left() { echo $(( budget - ($(date +%s) - t0) )); }
b="python3 -m megatrain_ray.bench --preset 7b --out $out"
run() {  # run TAG TIMEOUT ARGS...
  local tag=$1 limit=$2; shift 2
  stamp "$tag"
  timeout "$limit" $b --tag "$tag" "$@" > "$out/log_$tag.txt" 2>&1; echo "rc=$?" >> "$out/log_$tag.txt"
  grep -E "^megatrain_ray|^ours, share|^error|Error|^rc=" "$out/log_$tag.txt" | tail -4
}
run 7b-offload 150 --steps 3 --set runtime.offload_activations=true
grep -E "^ +0 " "$out/log_7b-offload.txt"  # step 0 includes the in-process compile
run 7b-clip 110 --steps 3
stamp "deepspeed sweep"
timeout $(( $(left) - 5 )) python3 benchmarks/peers.py --preset 7b --tokens 16384 --steps 2 --systems deepspeed \
  --sweep-layers 20,24 --timeout-s 200 --budget-s $(( $(left) - 20 )) --out "$out" > "$out/log_peers-sweep.txt" 2>&1
grep -E "^peers|layers|oom|ok" "$out/log_peers-sweep.txt" | tail -8
stamp done
