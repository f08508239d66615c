#!/usr/bin/env bash
# What does LoRA train at on one GPU over a 4-bit frozen base (lora.base_format=nf4: held and streamed as
# nf4, dequantized on the GPU), and how large a base does this host hold? The GPU check first (the
# dequantization on the GPU is the CPU's bit for bit, its time per layer, a small nf4 LoRA run on cuda);
# then the plans of both shapes in each base format; then the Qwen3-30B-A3B shape whole (48 layers,
# 30.5B) with rank-16 adapters, nf4 base, 262,144 tokens a step (16 micro-batches of 4 x 4,096; needs
# LoRA on mixtures of experts), and the Llama-3.1-70B shape (80 layers, hidden 8192) with rank-16
# adapters, nf4 base, 65,536 tokens a step (16 x 4 x 1,024), 10 steps.
#   bash benchmarks/qlora.sh OUT [PARTS]   # one H200, 128 GiB; PARTS: any of "check plan qwen3 70b"
#   SMOKE=1 bash benchmarks/qlora.sh OUT   # the CPU, the tiny preset
# Writes OUT/bench-<tag>.json (megatrain-ray bench: s/step, tokens/s, TFLOPS, GPU busy, link GB/s, host
# B/param), OUT/plan-*.txt and OUT/log_gpu-check.txt. BUDGET (s, default 570) is per command; the 70B
# run's 10 steps take longer than one 10-minute call at ~400 TFLOPS (about 70 s a step): STEPS70 (default
# 10) sets them, BUDGET70 (default 3000) its limit.
source "$(dirname "$0")/lib.sh"
parts=${2:-check plan qwen3 70b}
rc=0
QLORA=(--set lora.rank=16 --set lora.alpha=32 --set lora.base_format=nf4)
if smoke; then
  bench qlora-tiny 300 "${SMOKE_ARGS[@]}" --set lora.rank=4 --set lora.base_format=nf4
  run plan-qlora-tiny 120 python3 -m megatrain_ray.cli plan --device cpu $(shape_args tiny 2) --set lora.rank=4 \
    --set lora.base_format=nf4 || rc=$?
  stamp done; exit $rc
fi
case " $parts " in *" check "*)
  run gpu-check 600 python3 -m pytest -q -s tests/test_gpu_quant.py || rc=$?
  grep -E "dequantized|losses|over the link|passed|failed" "$out/log_gpu-check.txt" ;;
esac
case " $parts " in *" plan "*)
  run plan-qlora-qwen3 120 python3 -m megatrain_ray.cli plan --device cuda $(shape_args qwen3-30b-a3b) "${QLORA[@]}" \
    --set train.seq_len=4096 --set train.micro_batch_size=4 --set train.num_micro_batches=16 || rc=$?
  run plan-qlora-70b 120 python3 -m megatrain_ray.cli plan --device cuda $(shape_args 70b) "${QLORA[@]}" \
    --set train.seq_len=1024 --set train.micro_batch_size=4 --set train.num_micro_batches=16 || rc=$?
  for p in qwen3 70b; do cp "$out/log_plan-qlora-$p.txt" "$out/plan-qlora-$p.txt"; grep "LoRA\|frozen base" \
    "$out/plan-qlora-$p.txt"; done ;;
esac
case " $parts " in *" qwen3 "*)
  bench qlora-qwen3-30b-a3b-nf4-262144 "$(left 600)" --preset qwen3-30b-a3b --tokens 262144 --seq-len 4096 \
    --micro-batches 16 --steps 4 "${QLORA[@]}" ;;
esac
case " $parts " in *" 70b "*)
  BUDGET=${BUDGET70:-3000} bench qlora-70b-nf4-65536 "$(BUDGET=${BUDGET70:-3000} left 3000)" --preset 70b \
    --tokens 65536 --seq-len 1024 --micro-batches 16 --steps "${STEPS70:-10}" "${QLORA[@]}" ;;
esac
stamp done; exit $rc
