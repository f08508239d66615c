#!/usr/bin/env bash
# One device call: GPU tests, the 1b probe + baseline + single-process run, the 7b run.
# Usage (on the GPU machine, after installing the wheels): bash benchmarks/h200_session2.sh OUTDIR
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
inc=$(python3 -c "import sysconfig;print(sysconfig.get_paths()['include'])")
echo "python include: $inc $(ls $inc/Python.h 2>&1)" | tee "$out/env.txt"
nproc >> "$out/env.txt"; free -g >> "$out/env.txt"; df -h /tmp /dev/shm >> "$out/env.txt"
timeout 120 python3 -m pytest -q -x tests/test_gpu.py 2>&1 | tail -15 | tee "$out/log_gpu_tests.txt"
timeout 200 python3 -m megatrain_ray.bench --preset 1b --steps 5 --probe --baseline --single-process \
  --out "$out" 2>&1 | grep -v "^\s*$" | tee "$out/log_1b.txt" | tail -45
timeout 240 python3 -m megatrain_ray.bench --preset 7b --steps 6 --out "$out" 2>&1 | tee "$out/log_7b.txt" | tail -20
