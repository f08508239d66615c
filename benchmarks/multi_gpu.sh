#!/usr/bin/env bash
# What do more GPUs of one host give, from one host store? 1 and 2 GPUs side by side (65,536 tokens
# per GPU per step), then the two ways of summing gradients (experimental.grad_reduce allreduce vs host)
# and CPU pinning off (experimental.cpu_affinity=false), at the 7B shape.
#   bash benchmarks/multi_gpu.sh OUT               # two H200s: ~8 minutes
#   SMOKE=1 bash benchmarks/multi_gpu.sh OUT       # two compute workers on the CPU, a tiny model
# Writes OUT/bench-<variant>.json and prints: variant, GPUs, s/step, tok/s, x 1 GPU, host GiB.
source "$(dirname "$0")/lib.sh"
if smoke; then  # a Ray that counts 8 CPUs (a private one unless RAY_ADDRESS names one), so two workers fit a small box
  common=("${SMOKE_ARGS[@]}"); variants=("gpus-1-2:1,2")
  bench=(python3 -c "import os, sys, ray; ray.init(**({} if os.environ.get('RAY_ADDRESS') else {'num_cpus': 8}))
from megatrain_ray import bench; sys.exit(bench.main(sys.argv[1:]))")
else
  bench=(python3 -m megatrain_ray.cli bench)
  common=(--preset 7b --steps 5)
  variants=("gpus-1-2:1,2" "grad-reduce-host:2:--set experimental.grad_reduce=host" "no-affinity:2:--set experimental.cpu_affinity=false")
  nvidia-smi topo -m > "$out/topo.txt" 2>&1
fi
rc=0; tags=()
for v in "${variants[@]}"; do
  IFS=: read -r tag gpus extra <<< "$v"; tags+=("$tag")
  # shellcheck disable=SC2086  # the settings are words
  run "$tag" "$(left 330)" "${bench[@]}" "${common[@]}" --gpus "$gpus" $extra --tag "$tag" --out "$out" || rc=$?
done
python3 - "$out" "${tags[@]}" <<'PY'
import json, os, sys
out, one = sys.argv[1], None
print(f"{'variant':<28}{'GPUs':>5}{'s/step':>8}{'tok/s':>9}{'x 1 GPU':>9}{'host GiB':>9}")
for tag in sys.argv[2:]:
    path = os.path.join(out, f"bench-{tag}.json")
    if not os.path.exists(path):
        print(f"{tag:<28} (no result: see log_{tag}.txt)")
        continue
    report = json.load(open(path))
    for key, r in report["systems"].items():
        gpus = r["tokens_per_step"] // report["tokens_per_step"]
        one = r["tokens_per_s"] if gpus == 1 else one
        ratio = f"{r['tokens_per_s'] / one:>9.2f}" if one else f"{'-':>9}"
        print(f"{tag + ('' if key == 'megatrain_ray' else ':' + key[14:]):<28}{gpus:>5}{r['step_s']:>8.2f}"
              f"{r['tokens_per_s']:>9,.0f}{ratio}{r.get('host_peak_added_gib', 0):>9.1f}")
PY
stamp done; exit $rc
