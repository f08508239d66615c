#!/usr/bin/env bash
# How does megatrain_ray compare with plain GPU-resident PyTorch (eager, and with the layer compiled as
# ours is) and with its own engine without Ray, at each preset that fits the GPU resident?
#   bash benchmarks/vs_resident.sh OUT [PRESETS]   # default "1b 3b 7b"; one H200: ~9 minutes
#   SMOKE=1 bash benchmarks/vs_resident.sh OUT     # the CPU, a tiny model, without the GPU baselines
# Writes OUT/bench-resident-<preset>.json per preset and prints each table.
source "$(dirname "$0")/lib.sh"
presets=${2:-1b 3b 7b}
rc=0
if smoke; then
  run resident-tiny 300 python3 benchmarks/compare.py "${SMOKE_ARGS[@]}" --single-process --tag resident-tiny \
    --out "$out" || rc=$?
  grep -A3 "^system" "$out/log_resident-tiny.txt"
else
  for p in $presets; do
    run "resident-$p" "$(left 300)" python3 benchmarks/compare.py --preset "$p" --steps 5 --baseline \
      --baseline-compiled --single-process --tag "resident-$p" --out "$out" || rc=$?
    grep -A5 "^system" "$out/log_resident-$p.txt"
  done
fi
stamp done; exit $rc
