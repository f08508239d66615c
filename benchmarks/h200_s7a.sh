#!/usr/bin/env bash
# Session 7, first device call (nvidia-h200): the 7B benchmark with the defaults a user gets (the
# split AdamW update on: moments + stream copy first, master weights while the next step runs)
# against the same with runtime.split_update=false, side by side in one call (issue 16).
#   bash benchmarks/h200_s7a.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
for spec in "7b-split:" "7b-onepass:--set runtime.split_update=false"; do
  tag=${spec%%:*}; extra=${spec#*:}
  left=$(( 570 - ($(date +%s) - t0) )); (( left > 280 )) && left=280
  stamp "$tag ($extra), at most $left s"
  timeout $left python3 -m megatrain_ray.bench --preset 7b --steps 6 $extra --tag "$tag" --out "$out" \
    > "$out/log_$tag.txt" 2>&1; echo "rc=$?" >> "$out/log_$tag.txt"
  grep -E "^megatrain_ray|activations|^note|rc=|Error" "$out/log_$tag.txt" | cut -c1-300 | tail -5
done
stamp done
python3 benchmarks/bench_table.py "$out" 7b-split 7b-onepass
