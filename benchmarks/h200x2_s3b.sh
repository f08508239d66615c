#!/usr/bin/env bash
# Session 3, second device call (nvidia-h200-x2: 2x H200, 32 cores, 256 GiB), for the 7B ratio
# that the 128 GiB machine cannot give (DeepSpeed ZeRO-3 offload needs ~180 GiB of host RAM at
# 7.6 B). To stay comparable with the 1x H200 machine, ours and DeepSpeed run on GPU 0 and 16 CPUs
# (taskset), one after the other in one bench run; meanwhile the GPU-resident compiled baseline
# runs on GPU 1 and the other 16 CPUs (it hardly touches the host).
#   bash benchmarks/h200x2_s3b.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=$PWD/build/torch_extensions
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|NUMA" > "$out/machine.txt"; free -g >> "$out/machine.txt"
nvidia-smi topo -m >> "$out/machine.txt" 2>&1
n=$(nproc); half=$(( n / 2 ))
stamp "resident compiled baseline on GPU 1, CPUs $half-$((n - 1))"
CUDA_VISIBLE_DEVICES=1 taskset -c $half-$((n - 1)) timeout 400 python3 -c "
import numpy as np; from megatrain_ray import bench
np.save('/tmp/tok.npy', np.random.default_rng(0).integers(0, 152064, size=1_000_000))
cfg = bench._config('7b', 65536, 1024, 4, 4, '/tmp/tok.npy', [])
print('7b gpu-resident compiled:', bench.run_resident(cfg, 4, compiled=True))" > "$out/log_7b-resident-compiled.txt" 2>&1 &
stamp "ours + DeepSpeed on GPU 0, CPUs 0-$((half - 1))"
CUDA_VISIBLE_DEVICES=0 taskset -c 0-$((half - 1)) timeout 560 python3 benchmarks/peers.py bench --preset 7b --steps 4 \
  --peers deepspeed --peer-timeout-s 400 --tag 7b-x2 --out "$out" > "$out/log_7b-x2.txt" 2>&1
echo "rc=$?" >> "$out/log_7b-x2.txt"
wait
stamp done
tail -2 "$out/log_7b-resident-compiled.txt"
grep -E "^system|^megatrain_ray|^deepspeed|^ours, share|^rc=" "$out/log_7b-x2.txt"
