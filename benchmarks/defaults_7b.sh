#!/usr/bin/env bash
# What does the 7B model (Qwen2.5-7B shape, 7.6 B parameters) train at with the defaults on one GPU,
# beside PyTorch training it GPU-resident with the same compiled layer? The GPU tests first.
#   bash benchmarks/defaults_7b.sh OUT            # one H200: ~6 minutes
#   SMOKE=1 bash benchmarks/defaults_7b.sh OUT    # the CPU, a tiny model, no baseline (it needs a GPU)
# Writes OUT/bench-defaults-7b.json (every step, the summary of each system), a timeline PNG, the logs.
source "$(dirname "$0")/lib.sh"
if smoke; then
  run defaults-7b 300 python3 benchmarks/compare.py "${SMOKE_ARGS[@]}" --tag defaults-7b --out "$out"
else
  run gpu-tests 200 python3 -m pytest -q -x tests/test_gpu.py
  run defaults-7b "$(left 400)" python3 benchmarks/compare.py --preset 7b --steps 6 --baseline-compiled \
    --tag defaults-7b --out "$out"
fi
rc=$?
sed -n '/^system/,/^ours: /p' "$out/log_defaults-7b.txt"
stamp done; exit $rc
