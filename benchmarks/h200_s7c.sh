#!/usr/bin/env bash
# Session 7, third device call (nvidia-h200): the 7B benchmark with the defaults a user gets now
# (split update, the lean partitioner keeping more layers whole, the compiled LM-head loss, one
# queue host) against the code of the first call (commit 2ea19d9, unpacked by the caller into
# s7old/ with `git archive 2ea19d9 megatrain_ray | tar -x -C s7old`), side by side in one call;
# then the head and kept-graph probes (issue 16) in the time left.
#   bash benchmarks/h200_s7c.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
root=$PWD
for spec in "7b-now:$root" "7b-2ea19d9:$root/s7old"; do
  tag=${spec%%:*}; tree=${spec#*:}
  left=$(( 560 - ($(date +%s) - t0) )); (( left > 230 )) && left=230
  [ -d "$tree/megatrain_ray" ] || { echo "$tag: no tree at $tree"; continue; }
  stamp "$tag (code of $tree), at most $left s"
  (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout $left python3 -m megatrain_ray.bench --preset 7b --steps 6 \
    --tag "$tag" --out "$out") > "$out/log_$tag.txt" 2>&1; echo "rc=$?" >> "$out/log_$tag.txt"
  grep -E "^megatrain_ray|activations|^note|rc=|Error" "$out/log_$tag.txt" | cut -c1-300 | tail -5
done
for probe in head kept; do
  left=$(( 580 - ($(date +%s) - t0) ))
  (( left < 40 )) && { stamp "no time for the $probe probe"; continue; }
  (( left > 120 )) && left=120
  stamp "$probe probe, at most $left s"
  timeout $left python3 benchmarks/h200_${probe}_probe.py > "$out/log_${probe}_probe.txt" 2>&1
  echo "rc=$?" >> "$out/log_${probe}_probe.txt"; tail -12 "$out/log_${probe}_probe.txt" | cut -c1-200
done
stamp done
python3 benchmarks/bench_table.py "$out" 7b-now 7b-2ea19d9
