#!/usr/bin/env bash
# Issue 17: the largest model that trains per byte of host memory, with optim.state=8bit (compact
# AdamW state: 8-bit moments + bf16 master, 6 B/param with clipping, 4 without).
# On nvidia-h200 (1 GPU, 128 GiB host): the Qwen2.5-32B width with 38 layers (20.1B parameters),
# compact state, clipping on; then the AdamW kernel's rate on all cores.
# On nvidia-h200-x2 (256 GiB host, one GPU used): the Qwen2.5-32B shape (32.8B), compact, clipping on.
# With $2 = h200-25b: the 32B width with 48 layers (25.0B) on the 128 GiB box; with $2 = x2-40b (on
# nvidia-h200-x2): 80 layers (40.6B). On the 128 GiB box the GPU holds the step's bf16 gradients until
# the norm is known (runtime.hold_grads, default on cuda: 4 B/param of host memory, 2 of GPU memory);
# on x2 the GPU cannot hold both those and the activation checkpoints of a 32B model, so the gradients
# wait in host memory instead (runtime.hold_grads=false: 6 B/param; `plan` shows both totals).
# Each bench run: 3 steps of 65,536 tokens, under ~4-5 minutes. Chosen by the host's memory, or by $2.
#   bash benchmarks/h200_compact.sh $OUT [h200|h200-25b|x2|x2-40b]
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
mem_gib=$(awk '/MemTotal/ {printf "%d", $2 / 1048576}' /proc/meminfo)
kind=${2:-$([ "$mem_gib" -ge 200 ] && echo x2 || echo h200)}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; echo "host ${mem_gib} GiB, kind $kind"

stamp "native compact kernel rate on $(nproc) threads"
python3 benchmarks/compact_rate.py --threads "$(nproc)" > "$out/log_rate.txt" 2>&1; tail -3 "$out/log_rate.txt"

run() {  # tag, preset, layers, timeout, extra bench args...
  local tag=$1 preset=$2 layers=$3 limit=$4; shift 4
  stamp "$tag: plan"
  python3 -m megatrain_ray.cli plan --set optim.state=8bit --set train.seq_len=1024 --set train.micro_batch_size=16 \
    --set train.num_micro_batches=4 --device cuda "$@" \
    $(python3 -c "from megatrain_ray.model.presets import preset_shape as p; print(' '.join(f'--set model.{k}={v}' for k, v in p('$preset', $layers).items()))") \
    > "$out/plan_$tag.txt" 2>&1
  grep -E "^total|optimizer modes|B/param|error" "$out/plan_$tag.txt"
  stamp "$tag: bench"
  timeout "$limit" python3 -m megatrain_ray.bench --preset "$preset" --layers "$layers" --steps 3 \
    --set optim.state=8bit "$@" --out "$out" --tag "$tag" > "$out/log_$tag.txt" 2>&1
  echo "rc=$?" >> "$out/log_$tag.txt"
  grep -E "^system|^megatrain_ray|^ours|B/param|rc=|Error" "$out/log_$tag.txt" | cut -c1-400
}

if [ "$kind" = x2 ]; then
  run 32b-8bit 32b 64 420 --set runtime.hold_grads=false
elif [ "$kind" = x2-40b ]; then
  run 40b-8bit 32b 80 480 --set runtime.hold_grads=false
elif [ "$kind" = h200-25b ]; then
  run 25b-8bit 32b 48 400
else
  run 20b-8bit 32b 38 270
fi
stamp done
