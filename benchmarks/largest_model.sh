#!/usr/bin/env bash
# What is the largest model each optimizer mode trains on this machine? The plan's answer per mode,
# then one run at the size it names for the compact state (optim.state=8bit: bf16 master, 8-bit
# moments) and one with a bf16 master without clipping: the Qwen2.5-32B width with as many layers
# as the host holds (38 on a 128 GiB box: 20.1 B), 65,536 tokens a step, 3 steps.
#   bash benchmarks/largest_model.sh OUT [LAYERS_8BIT] [LAYERS_BF16]   # one H200, 128 GiB: ~9 minutes
#   SMOKE=1 bash benchmarks/largest_model.sh OUT                       # the CPU, a tiny model
# Writes OUT/plan.txt, OUT/bench-largest-8bit.json, OUT/bench-largest-bf16.json and the compact
# kernel's rate on this CPU (OUT/compact_rate.json).
source "$(dirname "$0")/lib.sh"
rc=0
if smoke; then
  run plan 120 python3 -m megatrain_ray.cli plan --set compute.device=cpu || rc=$?
  run largest-8bit 300 python3 -m megatrain_ray.cli bench "${SMOKE_ARGS[@]}" --set optim.state=8bit \
    --tag largest-8bit --out "$out" || rc=$?
  run compact-rate 120 python3 benchmarks/compact_rate.py --threads 1 --numel 1048576 --out "$out" || rc=$?
else
  l8=${2:-38}; l16=${3:-44}
  shape=$(shape_args 32b "$l8")
  # shellcheck disable=SC2086  # the settings are words
  run plan 120 python3 -m megatrain_ray.cli plan --device cuda $shape --set optim.state=8bit --set train.seq_len=1024 \
    --set train.micro_batch_size=16 --set train.num_micro_batches=4 || rc=$?
  run compact-rate 120 python3 benchmarks/compact_rate.py --threads "$(nproc)" --out "$out" || rc=$?
  run largest-8bit "$(left 280)" python3 -m megatrain_ray.cli bench --preset 32b --layers "$l8" --steps 3 \
    --set optim.state=8bit --tag largest-8bit --out "$out" || rc=$?
  run largest-bf16 "$(left 250)" python3 -m megatrain_ray.cli bench --preset 7b --layers "$l16" --steps 3 \
    --master-dtype bfloat16 --max-grad-norm 0 --tag largest-bf16 --out "$out" || rc=$?
fi
cp "$out/log_plan.txt" "$out/plan.txt" 2>/dev/null
grep -E "B/param|largest|^total" "$out/plan.txt" | head -12
for tag in largest-8bit largest-bf16; do grep -A2 "^system" "$out/log_$tag.txt" 2>/dev/null; done
stamp done; exit $rc
