#!/usr/bin/env bash
# What does keeping whole layer graphs on the GPU (memory.activations=auto, the default) save over
# recomputing every layer, at the 7B shape? Side by side in one call, then the layer probe: a kept
# layer against a recomputed one, the bytes per token a kept graph holds (against the planner's
# formula), the eager layer under each SDPA backend.
#   bash benchmarks/activation_placement.sh OUT    # one H200: ~7 minutes
#   SMOKE=1 bash benchmarks/activation_placement.sh OUT
# Writes OUT/plan.txt and OUT/bench-activations-{recompute,auto}.json (the probe's figures in the latter).
source "$(dirname "$0")/lib.sh"
rc=0
if smoke; then
  common=("${SMOKE_ARGS[@]}"); probe=()
  run plan 120 python3 -m megatrain_ray.cli plan --set compute.device=cpu || rc=$?
else
  common=(--preset 7b --steps 5); probe=(--probe)
  shape=$(shape_args 7b)
  # shellcheck disable=SC2086  # the settings are words
  run plan 120 python3 -m megatrain_ray.cli plan --device cuda $shape --set train.seq_len=1024 \
    --set train.micro_batch_size=16 --set train.num_micro_batches=4 || rc=$?
fi
cp "$out/log_plan.txt" "$out/plan.txt"; grep -E "^activation" -A1 "$out/plan.txt"
run activations-recompute "$(left 200)" python3 benchmarks/compare.py "${common[@]}" \
  --set memory.activations=recompute --tag activations-recompute --out "$out" || rc=$?
run activations-auto "$(left 300)" python3 benchmarks/compare.py "${common[@]}" "${probe[@]}" \
  --tag activations-auto --out "$out" || rc=$?
python3 benchmarks/bench_table.py "$out" activations-recompute activations-auto
grep "^probe:" "$out/log_activations-auto.txt" | cut -c1-600
stamp done; exit $rc
