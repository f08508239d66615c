#!/usr/bin/env bash
# Where should the optimizer update run? The Qwen3-30B-A3B shape at 8 layers (5.6B, exact AdamW), 65,536
# tokens a step (4 micro-batches of 4 x 4,096), whose host update outlasts the GPU's step, trained with
# optim.placement host, device and auto side by side in one call: s/step, GPU busy, the sink's and the
# device's update busy time, and the plan's expected step time for each (pace.UpdatePace).
#   bash benchmarks/update_placement.sh OUT [PLACEMENTS]   # one H200; PLACEMENTS: any of "host device auto"
#   SHAPE=moe36-8bit bash benchmarks/update_placement.sh OUT "host auto"   # the same shape at 36 layers (23.1B)
#                        with optim.state=8bit, 262,144 tokens a step (16 micro-batches of 4 x 4,096; MICRO_BATCH=8:
#                        8 of 8 x 4,096), 4 steps
#   SMOKE=1 bash benchmarks/update_placement.sh OUT        # the CPU, small-moe at 2 layers: host and device
# Writes OUT/bench-<name>-<placement>.json, OUT/plan-<name>-<placement>.txt and OUT/<name>.txt (the table);
# <name> is "placement", or "placement-moe36-8bit" with that SHAPE. BUDGET (s, default 570) bounds the
# whole; STEPS (default 6, 4 for moe36-8bit) the steps of each run; each run gets at most 300 s (540 s at
# moe36-8bit, whose store takes a minute to fill).
source "$(dirname "$0")/lib.sh"
placements=${2:-host device auto}
name=placement
cap=300
rc=0
if smoke; then
  placements="host device"
  shape=(--preset small-moe --layers 2 --tokens 1024 --seq-len 128 --micro-batches 2 --steps 3 --set compute.device=cpu)
  plan_shape=($(shape_args small-moe 2) --set train.seq_len=128 --set train.micro_batch_size=4
              --set train.num_micro_batches=2 --set compute.device=cpu)
  device=cpu
elif [ "${SHAPE:-}" = moe36-8bit ]; then
  name=placement-moe36-8bit
  cap=540
  mbs=${MICRO_BATCH:-4}  # sequences a micro-batch: 262,144 tokens in 64 / MICRO_BATCH micro-batches
  shape=(--preset qwen3-30b-a3b --layers 36 --tokens 262144 --seq-len 4096 --micro-batches $((64 / mbs))
         --steps "${STEPS:-4}" --set optim.state=8bit)
  plan_shape=($(shape_args qwen3-30b-a3b 36) --set model.max_position_embeddings=4096 --set train.seq_len=4096
              --set train.micro_batch_size="$mbs" --set train.num_micro_batches=$((64 / mbs)) --set optim.state=8bit)
  device=cuda
else
  shape=(--preset qwen3-30b-a3b --layers 8 --tokens 65536 --seq-len 4096 --micro-batches 4 --steps "${STEPS:-6}")
  plan_shape=($(shape_args qwen3-30b-a3b 8) --set model.max_position_embeddings=4096 --set train.seq_len=4096
              --set train.micro_batch_size=4 --set train.num_micro_batches=4)
  device=cuda
fi
for p in $placements; do
  run "plan-$name-$p" 120 python3 -m megatrain_ray.cli plan --device "$device" "${plan_shape[@]}" \
    --set optim.placement="$p" || rc=$?
  cp "$out/log_plan-$name-$p.txt" "$out/plan-$name-$p.txt"
  bench "$name-$p" "$(left $cap)" "${shape[@]}" --set optim.placement="$p"
done
python3 - "$out" "$name" $placements > "$out/$name.txt" <<'PY' || rc=$?
import json, os, re, sys

out, name, rows = sys.argv[1], sys.argv[2], []
print(f"{'placement':<10} {'s/step':>8} {'plan s':>8} {'vs plan':>8} {'GPU busy':>9} {'host update':>12} "
      f"{'device update':>14}")
for p in sys.argv[3:]:
    ours = json.load(open(os.path.join(out, f"bench-{name}-{p}.json")))["systems"]["megatrain_ray"]
    plan = open(os.path.join(out, f"plan-{name}-{p}.txt")).read()
    expected = re.search(r"expected step time with them: ~([\d.]+) (ms|s)\b", plan)
    plan_s = float(expected.group(1)) / (1e3 if expected.group(2) == "ms" else 1) if expected else float("nan")
    print(f"{p:<10} {ours['step_s']:>8.3f} {plan_s:>8.3f} {ours['step_s'] / plan_s - 1:>+8.1%} "
          f"{ours['compute_busy_frac']:>9.1%} {ours.get('update_busy_frac', float('nan')):>12.1%} "
          f"{ours.get('device_update_busy_frac', float('nan')):>14.1%}")
PY
cat "$out/$name.txt"
stamp done; exit $rc
