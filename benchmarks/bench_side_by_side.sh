#!/usr/bin/env bash
# Several 7B benchmark runs side by side in one device call, then their table: each argument is
# TAG:SETTINGS, the settings passed to `megatrain_ray.bench --preset 7b --steps 6` as they are
# (empty: the defaults). Each run gets at most 280 s of the BUDGET seconds (default 570) left.
#   bash benchmarks/bench_side_by_side.sh $OUT "7b-host:" "7b-edges:--set runtime.device_adamw=edges"
set -uo pipefail
out=${1:-/tmp/out}; shift; mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
tags=()
for spec in "$@"; do
  tag=${spec%%:*}; extra=${spec#*:}; tags+=("$tag")
  left=$(( ${BUDGET:-570} - ($(date +%s) - t0) )); (( left > 280 )) && left=280
  stamp "$tag ($extra), at most $left s"
  # shellcheck disable=SC2086  # the settings are words
  timeout $left python3 -m megatrain_ray.bench --preset 7b --steps 6 $extra --tag "$tag" --out "$out" \
    > "$out/log_$tag.txt" 2>&1; echo "rc=$?" >> "$out/log_$tag.txt"
  grep -E "^megatrain_ray|activations|^note|rc=|Error" "$out/log_$tag.txt" | cut -c1-300 | tail -5
done
stamp done
python3 benchmarks/bench_table.py "$out" "${tags[@]}"
