#!/usr/bin/env bash
# Session 6, third device call (nvidia-h200): the largest compact-state model on the 128 GiB box
# (20.1 B, issue 17), then the 524,288-token sequence at the 7B width (issue 15) in the time left.
#   bash benchmarks/h200_s6c.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
bash benchmarks/h200_compact.sh "$out" h200 2>&1 | grep -v "^\[.*native compact kernel" | tail -12
left=$(( 590 - ($(date +%s) - t0) ))
echo "[$(( $(date +%s) - t0 )) s] 524288 tokens, at most $left s"
S=524288; tag="7b-4l-$S"
timeout $left python3 -m megatrain_ray.bench --preset 7b --layers 4 --tokens $S --seq-len $S --micro-batches 1 \
  --steps 2 --set runtime.mlp_chunk_size=16384 --set model.max_position_embeddings=$S --out "$out" --tag "$tag" \
  > "$out/log_$tag.txt" 2>&1; echo "rc=$?" >> "$out/log_$tag.txt"
grep -E "^megatrain_ray|^system|activations|rc=|Error" "$out/log_$tag.txt" | cut -c1-300 | tail -6
