#!/usr/bin/env bash
# Issue 13 on nvidia-h200-x2 (2x H200, 32 cores, 256 GiB): how the two GPUs' gradients are summed
# (runtime.grad_reduce allreduce vs host) and whether pinning threads near the GPU matters
# (runtime.cpu_affinity on vs off), at the 7B shape with 65,536 tokens per GPU per step, 5 steps
# (s/step = median of the last 3 step periods).
#   bash benchmarks/h200x2_multi.sh $OUT          # ~7-9 min; all under 580 s, the third run skipped past 430 s
# 0. the GPUs' PCI addresses and local CPUs as megatrain_ray.engine.affinity reads them, and its GPU test
# 1. --gpus 1,2, allreduce, affinity on (the defaults): the 1-GPU row and the 2-GPU ratio
# 2. --gpus 2, grad_reduce=host
# 3. --gpus 2, cpu_affinity=false (if time is left)
# The last lines are one table: variant, GPUs, s/step, tok/s, x 1 GPU, steady steps, host GiB, placement.
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi --query-gpu=name,pci.bus_id,memory.total --format=csv,noheader; nproc
nvidia-smi topo -m > "$out/topo.txt" 2>&1; head -5 "$out/topo.txt"
python3 - <<'EOF' | tee "$out/affinity.txt"
import torch
from megatrain_ray.engine.affinity import format_cpulist, gpu_pci_address, local_cpus, plan_cpus
import os
tops = []
for i in range(torch.cuda.device_count()):
    pci = gpu_pci_address(i)
    node, cpus = local_cpus(pci)
    tops.append(cpus)
    print(f"GPU {i}: pci {pci}, NUMA node {node}, local CPUs {format_cpulist(cpus) if cpus else None}")
picks, rest = plan_cpus(tops, sorted(os.sched_getaffinity(0)))
print("plan:", [format_cpulist(p) if p else None for p in picks], "AdamW:", format_cpulist(rest) if rest else None)
EOF
timeout 60 python3 -m pytest -q tests/test_affinity.py 2>&1 | tail -1
bench() {  # $1 tag, $2 gpus, $3.. --set overrides
  local tag=$1 gpus=$2; shift 2
  local left=$(( 580 - ($(date +%s) - t0) ))  # the whole script stays under the device's 10-minute call
  (( left > 330 )) && left=330
  stamp "bench $tag (--gpus $gpus $*), at most $left s"
  timeout $left python3 -m megatrain_ray.bench --preset 7b --steps 5 --gpus "$gpus" --tag "$tag" --out "$out" "$@" \
    > "$out/log_$tag.txt" 2>&1; echo "rc=$?" >> "$out/log_$tag.txt"
  grep -E "^megatrain_ray|GPUs:|^note|rc=|Error" "$out/log_$tag.txt" | cut -c1-200
}
bench 7b-allreduce 1,2
bench 7b-host 2 --set runtime.grad_reduce=host
if (( $(date +%s) - t0 < 430 )); then
  bench 7b-noaffinity 2 --set runtime.cpu_affinity=false
else
  stamp "skipped 7b-noaffinity (time)"
fi
stamp done
python3 - "$out" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
one = None
print(f"{'variant':<26}{'GPUs':>5}{'s/step':>8}{'tok/s':>9}{'x 1 GPU':>9}{'steady':>7}{'host GiB':>9}  cpu placement")
for tag in ("7b-allreduce", "7b-host", "7b-noaffinity"):
    path = os.path.join(out, f"bench-{tag}.json")
    if not os.path.exists(path):
        print(f"{tag:<26} (no result: see log_{tag}.txt)")
        continue
    for key, r in json.load(open(path))["systems"].items():
        gpus = r["tokens_per_step"] // 65536
        if gpus == 1:
            one = r["tokens_per_s"]
        ratio = f"{r['tokens_per_s'] / one:>9.2f}" if one else f"{'-':>9}"
        place = "; ".join(r.get("cpu_placement", []))[:110]
        print(f"{tag + ('' if key == 'megatrain_ray' else ':' + key[14:]):<26}{gpus:>5}{r['step_s']:>8.2f}"
              f"{r['tokens_per_s']:>9,.0f}{ratio}{r.get('steady_periods', 0):>7}{r.get('host_peak_added_gib', 0):>9.1f}  {place}")
EOF
