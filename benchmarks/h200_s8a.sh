#!/usr/bin/env bash
# Session 8 (written; not yet run: this session had no device time left). One call on nvidia-h200:
# the 7B benchmark with today's defaults against the same code with the embedding's and the LM head's
# AdamW on the GPU (runtime.device_adamw=edges, issue 16), side by side, then the table.
#   bash benchmarks/h200_s8a.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
for spec in "7b-host:" "7b-edges:--set runtime.device_adamw=edges"; do
  tag=${spec%%:*}; extra=${spec#*:}
  left=$(( 570 - ($(date +%s) - t0) )); (( left > 270 )) && left=270
  stamp "$tag, at most $left s"
  # shellcheck disable=SC2086
  timeout $left python3 -m megatrain_ray.bench --preset 7b --steps 6 --tag "$tag" --out "$out" $extra \
    > "$out/log_$tag.txt" 2>&1; echo "rc=$?" >> "$out/log_$tag.txt"
  grep -E "^megatrain_ray|activations|^note|rc=|Error" "$out/log_$tag.txt" | cut -c1-300 | tail -5
done
stamp done
python3 benchmarks/bench_table.py "$out" 7b-host 7b-edges
