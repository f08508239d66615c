#!/usr/bin/env bash
# What does LoRA on a whole mixture of experts train at on one GPU, beside a GPU-resident transformers
# + peft run of the same layers? The Qwen3-30B-A3B shape, all 48 layers (30.5B parameters, a bf16
# frozen base streamed from host memory), rank-16 adapters (alpha 32) on attention (q/k/v/o) and on
# every routed expert's fused gate_up_proj and down_proj (PEFT's target_parameters), the routers frozen,
# 262,144 tokens a step (16 micro-batches of 4 x 4,096); the resident peft run with as many of the same
# layers as fit the GPU. The comparison is tokens/s per layer: tokens/s x layers of each run.
#   bash benchmarks/moe_lora.sh OUT [PARTS]   # one H200, 128 GiB; PARTS: any of "plan lora resident"
#   SMOKE=1 bash benchmarks/moe_lora.sh OUT   # the CPU, the small-moe preset, a resident run of 1 layer
# Writes OUT/bench-<tag>.json (megatrain-ray bench: s/step, tokens/s, TFLOPS in both conventions as a
# LoRA step runs them with active parameters, GPU busy, host B/param), OUT/resident-lora-<tag>.json,
# OUT/plan-moe-lora.txt and OUT/ratio.txt. Each run is its own command: BUDGET (s, default 570) is per command.
source "$(dirname "$0")/lib.sh"
parts=${2:-plan lora resident}
rc=0
LORA=(--set lora.rank=16 --set lora.alpha=32 --set lora.target_modules=q_proj,k_proj,v_proj,o_proj)
if smoke; then
  bench moe-lora-tiny 300 --preset small-moe --layers 2 --tokens 1024 --seq-len 128 --micro-batches 2 --steps 3 \
    --set compute.device=cpu --set lora.rank=4 --set lora.target_modules=q_proj,k_proj,v_proj,o_proj
  run resident-lora-moe-tiny 300 python3 benchmarks/lora_resident.py --preset small-moe --layers 1 --tokens 1024 \
    --seq-len 128 --micro-batches 2 --steps 2 --rank 4 --targets q_proj,k_proj,v_proj,o_proj --device cpu \
    --tag moe-tiny --out "$out" || rc=$?
  grep "^resident-lora" "$out/log_resident-lora-moe-tiny.txt"
  lora_ratio "$out/ratio.txt" "$out/bench-moe-lora-tiny.json" "$out/resident-lora-moe-tiny.json" || rc=$?
  stamp done; exit $rc
fi
step=(--tokens 262144 --seq-len 4096 --micro-batches 16 --steps 4)
case " $parts " in *" plan "*)
  run plan-moe-lora 120 python3 -m megatrain_ray.cli plan --device cuda $(shape_args qwen3-30b-a3b) \
    --set model.max_position_embeddings=4096 \
    --set lora.rank=16 --set lora.alpha=32 --set lora.target_modules=q_proj,k_proj,v_proj,o_proj \
    --set train.seq_len=4096 --set train.micro_batch_size=4 --set train.num_micro_batches=16 || rc=$?
  cp "$out/log_plan-moe-lora.txt" "$out/plan-moe-lora.txt" ;;
esac
case " $parts " in *" lora "*)
  bench qwen3-30b-a3b-48l-lora-r16-262144 "$(left 600)" --preset qwen3-30b-a3b "${step[@]}" "${LORA[@]}" ;;
esac
case " $parts " in *" resident "*)  # as many of the same layers as fit the GPU resident (all 48, or the most that fit)
  run resident-lora-moe "$(left 600)" python3 benchmarks/lora_resident.py --preset qwen3-30b-a3b --layers 48 --rank 16 \
    --targets q_proj,k_proj,v_proj,o_proj --tokens 262144 --seq-len 4096 --micro-batches 16 \
    --tag qwen3-30b-a3b-262144 --out "$out" || rc=$?
  grep "^resident-lora" "$out/log_resident-lora-moe.txt"
  lora_ratio "$out/ratio.txt" "$out/bench-qwen3-30b-a3b-48l-lora-r16-262144.json" "$out/resident-lora-qwen3-30b-a3b-262144.json" || rc=$? ;;
esac
stamp done; exit $rc
