#!/usr/bin/env bash
# Session 9, call 2 on nvidia-h200: how many layers the GPU can keep whole beside the owned units.
# Call 1 (h200_s9a.sh) left the step GPU-bound with runtime.device_adamw=edges+1 (99% busy, 11 of 28
# layers kept by the plan's GPU_USABLE=0.9, peak 117.3 GiB allocated): each more kept layer saves its
# recompute (~49 ms). Here 13 kept with edges+1, 13 with edges, and 13 with edges+1 under
# expandable_segments; nvidia-smi logs what the device really holds (reserved + context) meanwhile.
#   bash benchmarks/h200_s9b.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=timestamp,memory.used,memory.total --format=csv -lms 500 > "$out/nvidia_smi.csv" 2>&1 &
smi=$!
keep="--set runtime.activations=keep=13,host=0"
BUDGET=${BUDGET:-560} bash benchmarks/bench_side_by_side.sh "$out" \
  "7b-e1-k13:--set runtime.device_adamw=edges+1 $keep" "7b-e-k13:--set runtime.device_adamw=edges $keep"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True BUDGET=$(( 560 - SECONDS )) bash benchmarks/bench_side_by_side.sh "$out" \
  "7b-e1-k13-exp:--set runtime.device_adamw=edges+1 $keep"
kill $smi
python3 benchmarks/bench_table.py "$out" 7b-e1-k13 7b-e-k13 7b-e1-k13-exp
python3 - "$out/nvidia_smi.csv" <<'PY'
import sys
used = [int(l.split(",")[1].split()[0]) for l in open(sys.argv[1]) if "MiB" in l and "memory" not in l]
print(f"nvidia-smi: max used {max(used) / 1024:.1f} GiB of {open(sys.argv[1]).read().split(',')[-1].split()[0]} MiB")
PY
