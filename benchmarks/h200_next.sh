#!/usr/bin/env bash
# Prepared for the next device session (not run yet): the measurements issue 3 still lacks, ~13
# minutes in all: more than one call's 10-minute limit, so run it as two calls (comment out halves). Usage on the GPU machine, after installing the wheels:
#   bash benchmarks/h200_next.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
b="python3 -m megatrain_ray.bench --preset 7b --out $out"
timeout 90 python3 -m pytest -q -x tests/test_gpu.py 2>&1 | tail -3 | tee "$out/log_gpu_tests.txt"
# updates overlap the backward when there is no clipping
timeout 150 $b --steps 5 --max-grad-norm 0 --tag 7b-noclip 2>&1 | tail -4 | tee "$out/log_7b-noclip.txt"
# GPU memory flat in depth with the checkpoints offloaded (compare GPU GiB of the two)
timeout 120 $b --steps 3 --set runtime.offload_activations=true --tag 7b-offload 2>&1 | tail -4 | tee "$out/log_7b-offload.txt"
timeout 90 $b --steps 3 --layers 14 --set runtime.offload_activations=true --tag 7b-14-offload 2>&1 | tail -4 \
  | tee "$out/log_7b-14-offload.txt"
# bf16 master without clipping: gradient ring, 10 B/param + O(unit) in the store
timeout 120 $b --steps 3 --master-dtype bfloat16 --max-grad-norm 0 --tag 7b-bf16-noclip 2>&1 | tail -4 \
  | tee "$out/log_7b-bf16-noclip.txt"
# the GPU-resident baseline with the layer compiled too (the 1.25x of session 2 was against eager)
timeout 200 python3 -c "
import numpy as np; from megatrain_ray import bench
np.save('/tmp/tok.npy', np.random.default_rng(0).integers(0, 152064, size=1_000_000))
cfg = bench._config('7b', 65536, 1024, 4, 4, '/tmp/tok.npy', [])
print('7b gpu-resident compiled:', bench.run_resident(cfg, 4, compiled=True))" 2>&1 | tail -2 | tee "$out/log_7b-resident-compiled.txt"
