#!/usr/bin/env bash
# Session 6, fourth device call (nvidia-h200-x2): 7B data parallel on both GPUs, gradients summed by
# the all-reduce (default) vs on the host (runtime.grad_reduce=host), CPU placement on; kept short
# to fit the session's device time.
#   bash benchmarks/h200x2_s6d.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi --query-gpu=name,pci.bus_id --format=csv,noheader; nproc
for spec in "7b-x2-allreduce:" "7b-x2-host:--set runtime.grad_reduce=host"; do
  tag=${spec%%:*}; extra=${spec#*:}
  left=$(( 470 - ($(date +%s) - t0) )); (( left > 240 )) && left=240
  stamp "$tag ($extra), at most $left s"
  timeout $left python3 -m megatrain_ray.bench --preset 7b --steps 5 --gpus 2 $extra --tag "$tag" --out "$out" \
    > "$out/log_$tag.txt" 2>&1; echo "rc=$?" >> "$out/log_$tag.txt"
  grep -E "^megatrain_ray|cpu placement|GPUs|rc=|Error" "$out/log_$tag.txt" | cut -c1-300 | tail -5
done
stamp done
