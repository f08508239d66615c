#!/usr/bin/env bash
# Prepared for the next device session (not run yet): where each system stops on the 128 GiB
# machine (issue 6), 7b shape with more or fewer layers, 16k tokens/step, 2 steps each, ~9 minutes.
#   bash benchmarks/h200_next_sizes.sh $OUT
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=$PWD/build/torch_extensions
p="python3 benchmarks/peers.py --preset 7b --tokens 16384 --steps 2 --timeout-s 150 --out $out"
timeout 200 $p --systems deepspeed --sweep-layers 16,20,24 --budget-s 190 2>&1 | tail -6
timeout 170 $p --systems fsdp2 --sweep-layers 28,36 --budget-s 160 2>&1 | tail -6
# ours: fp32 master at 32 layers (8.5 B, 111 GiB store), bf16 master without clipping at 44 layers (11.3 B, 106 GiB)
b="python3 -m megatrain_ray.bench --preset 7b --tokens 16384 --micro-batches 1 --steps 2 --out $out"
timeout 100 $b --layers 32 --tag 7b-32layers 2>&1 | tail -3
timeout 110 $b --layers 44 --master-dtype bfloat16 --max-grad-norm 0 --tag 7b-44layers-bf16 2>&1 | tail -3
