#!/usr/bin/env bash
# Issue 15, model side (nvidia-h200: 1x H200, 128 GiB host): the Qwen2.5-7B width at 4 layers, one
# sequence per step of S = 131,072 and 524,288 tokens, checkpoints offloaded, the MLP in chunks of
# 16,384 tokens (runtime.mlp_chunk_size; the default beyond 65,536 tokens). Also the GPU tests (tiled
# MLP through the compute worker, FlexAttention against the dense document mask) and, for each S,
# what `megatrain-ray plan` predicts for the GPU peak and the longest context, next to what ran.
# Confirms the work when: both runs finish with finite losses, 524,288 fits (it ran out of GPU
# memory untiled), and each measured GPU peak is within 10% of the plan's "total GPU".
#   bash benchmarks/h200_longctx.sh $OUT [PARTS]
# PARTS (default "tests 131072 524288"): any of tests, 131072, 524288, so that one device call of
# at most 10 minutes can run a part (the 524,288-token run alone may take ~5 minutes).
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
parts=" ${2:-tests 131072 524288} "
export PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
shape="--set runtime.offload_activations=true --set runtime.mlp_chunk_size=16384"
if [[ $parts == *" tests "* ]]; then
  stamp "gpu tests"
  timeout 240 python3 -m pytest -q tests/test_gpu.py > "$out/log_gpu_tests.txt" 2>&1; tail -1 "$out/log_gpu_tests.txt"
fi
for S in 131072 524288; do
  [[ $parts == *" $S "* ]] || continue
  tag="7b-4l-${S}"
  stamp "$tag"
  timeout 420 python3 -m megatrain_ray.bench --preset 7b --layers 4 --tokens $S --seq-len $S --micro-batches 1 \
    --steps 2 $shape --set model.max_position_embeddings=$S --out "$out" --tag "$tag" > "$out/log_$tag.txt" 2>&1
  echo "rc=$?" >> "$out/log_$tag.txt"
  grep -E "^megatrain_ray|^ours|^rc=" "$out/log_$tag.txt"
  python3 -m megatrain_ray.cli plan --device cuda $shape --set train.seq_len=$S --set model.max_position_embeddings=$S \
    --set train.micro_batch_size=1 --set train.num_micro_batches=1 --set model.model_type=qwen2 \
    --set model.hidden_size=3584 --set model.intermediate_size=18944 --set model.num_hidden_layers=4 \
    --set model.num_attention_heads=28 --set model.num_key_value_heads=4 --set model.vocab_size=152064 \
    --set model.rope_theta=1000000.0 --set train.save_final=false > "$out/plan_$tag.txt" 2>&1
  grep -E "^total GPU|^longest context" "$out/plan_$tag.txt"
done
stamp done
python3 - "$out" <<'PY'
import json, re, sys, glob, os
out = sys.argv[1]
print(f"{'tokens':>9} {'s/step':>8} {'tok/s':>8} {'TFLOPS 6NT':>10} {'TFLOPS attn':>11} {'GPU GiB':>8} {'plan GiB':>8} {'loss':>14}")
for S in (131072, 524288):
    tag = f"7b-4l-{S}"
    try:
        rep = json.load(open(glob.glob(os.path.join(out, f"bench-*{tag}*.json"))[0]))
        r = rep["systems"]["megatrain_ray"]
    except (IndexError, KeyError, ValueError):
        if os.path.exists(os.path.join(out, f"log_{tag}.txt")):
            print(f"{S:>9} failed: see log_{tag}.txt")
        continue
    plan = open(os.path.join(out, f"plan_{tag}.txt")).read()
    m = re.search(r"^total GPU\s+([\d.]+) GiB", plan, re.M)
    losses = r.get("losses", [])
    print(f"{S:>9} {r['step_s']:>8.2f} {r['tokens_per_s']:>8,.0f} {r.get('tflops_6nt', float('nan')):>10.1f} "
          f"{r.get('tflops_palm', float('nan')):>11.1f} {r['device_peak_gib']:>8.1f} {m.group(1) if m else '?':>8} "
          f"{' > '.join(f'{x:.3f}' for x in losses[:2]):>14}")
PY
