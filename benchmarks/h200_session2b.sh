#!/usr/bin/env bash
# Second device call of 2026-11-30 (session 2): AdamW probe at the 7B layer size, the 7B runs with
# and without clipping (the first with the GPU-resident baseline), and the 14-layer memory check.
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
timeout 60 python3 -m pytest -q -x tests/test_gpu.py -k "False-False" 2>&1 | tail -2
timeout 60 python3 -c "
import json; from megatrain_ray.bench import adamw_probe
print('adamw probe (7b layer):', json.dumps({k: round(v, 2) for k, v in adamw_probe(233_000_000, 16).items()}))" \
  2>&1 | tee "$out/log_adamw.txt"
timeout 170 python3 -m megatrain_ray.bench --preset 7b --steps 5 --out "$out" --tag 7b-clip 2>&1 \
  | tee "$out/log_7b-clip.txt" | tail -9
timeout 150 python3 -m megatrain_ray.bench --preset 7b --steps 5 --max-grad-norm 0 --out "$out" --tag 7b-noclip 2>&1 \
  | tee "$out/log_7b-noclip.txt" | tail -9
timeout 90 python3 -m megatrain_ray.bench --preset 7b --layers 14 --steps 3 --out "$out" --tag 7b-14layers 2>&1 \
  | tee "$out/log_7b-14layers.txt" | tail -4
timeout 120 python3 -c "
import sys; sys.argv = ['x']
from megatrain_ray import bench
import numpy as np; np.save('/tmp/tok.npy', np.random.default_rng(0).integers(0, 152064, size=1_000_000))
cfg = bench._config('7b', 65536, 1024, 4, 4, '/tmp/tok.npy', [])
print('7b gpu-resident baseline:', bench.run_resident(cfg, 4))" 2>&1 | tail -3 | tee "$out/log_7b-resident.txt"
