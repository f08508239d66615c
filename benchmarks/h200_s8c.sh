#!/usr/bin/env bash
# Session 8 (written; not yet run). One call on nvidia-h200, after h200_s8a.sh: the 7B benchmark
# with the first decoder layer on the GPU too (runtime.device_adamw=edges+1: the sink's first update
# after the step boundary is then layers.1's, while the GPU runs the embedding and layer 0), then the
# table of all three runs (copy s8a's bench-7b-*.json into the same OUT first to have them side by side).
#   bash benchmarks/h200_s8c.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
timeout 300 python3 -m megatrain_ray.bench --preset 7b --steps 6 --tag 7b-edges1 --out "$out" \
  --set runtime.device_adamw=edges+1 > "$out/log_7b-edges1.txt" 2>&1; echo "rc=$?" >> "$out/log_7b-edges1.txt"
grep -E "^megatrain_ray|activations|^note|rc=|Error" "$out/log_7b-edges1.txt" | cut -c1-300 | tail -5
python3 benchmarks/bench_table.py "$out" 7b-host 7b-edges 7b-edges1
