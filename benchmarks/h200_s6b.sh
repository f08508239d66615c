#!/usr/bin/env bash
# Session 6, second device call (nvidia-h200): the compact-state GPU test again (after drawing the
# initial weights in fp32 for every master dtype), the 7B benchmark with the defaults a user gets
# (activations placed by the planner) with the layer/AdamW probe, and the same with fp32 gradients
# (issue 19's cost), side by side.
#   bash benchmarks/h200_s6b.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
stamp "gpu compact test"
timeout 120 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_compact.py > "$out/log_gpu_compact.txt" 2>&1
echo "rc=$?" >> "$out/log_gpu_compact.txt"
grep -E "passed|failed|^E  |rc=|'exact'" "$out/log_gpu_compact.txt" | cut -c1-400 | tail -6
for spec in "7b-auto:--probe" "7b-fp32grad:--set runtime.grad_dtype=float32"; do
  tag=${spec%%:*}; extra=${spec#*:}
  left=$(( 585 - ($(date +%s) - t0) )); (( left > 260 )) && left=260
  stamp "$tag ($extra), at most $left s"
  timeout $left python3 -m megatrain_ray.bench --preset 7b --steps 5 $extra --tag "$tag" --out "$out" \
    > "$out/log_$tag.txt" 2>&1; echo "rc=$?" >> "$out/log_$tag.txt"
  grep -E "^megatrain_ray|activations|^note|rc=|Error" "$out/log_$tag.txt" | cut -c1-300 | tail -6
done
stamp done
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
print(f"{'run':<14}{'s/step':>8}{'TF 6NT':>8}{'TF PaLM':>9}{'GPU GiB':>9}")
for tag in ("7b-auto", "7b-fp32grad"):
    path = os.path.join(out, f"bench-{tag}.json")
    if not os.path.exists(path):
        print(f"{tag:<14}  (no result: see log_{tag}.txt)")
        continue
    r = json.load(open(path))["systems"]["megatrain_ray"]
    print(f"{tag:<14}{r['step_s']:>8.3f}{r['tflops_6nt']:>8.1f}{r['tflops_palm']:>9.1f}{r.get('device_peak_gib', 0):>9.1f}")
PY
