#!/usr/bin/env bash
# What do the 100B+ mixtures of experts train at with LoRA on one GPU and 128 GiB of host memory?
# gpt-oss-120b whole (36 layers of 128 experts, top-4; 116.8B) with rank-16 adapters (alpha 32) on
# attention and every routed expert over its MXFP4 base (lora.base_format=mxfp4: the experts held and
# streamed as the Hub stores them, 4.25 bits a weight, dequantized on the GPU; the rest bf16), at 65,536
# and 262,144 tokens a step (16 micro-batches of 1 or 4 x 4,096); GLM-4.5-Air whole (46 layers, 106.9B)
# the same over a 4-bit (nf4) base; gpt-oss-20b over its MXFP4 base beside transformers + peft resident
# on the GPU (its experts bf16, as transformers dequantizes them; as many layers as fit), tokens/s per layer.
#   bash benchmarks/gpt_oss.sh OUT [PARTS]   # one H200, 128 GiB; PARTS: any of
#                                            # "plan 120b-65k 120b-262k air-65k air-262k 20b resident"
#   SMOKE=1 bash benchmarks/gpt_oss.sh OUT   # the CPU: 2-layer stand-ins of both families
# Writes OUT/bench-<tag>.json (megatrain-ray bench: s/step, tokens/s, TFLOPS in both conventions as a
# LoRA step runs them with active parameters, GPU busy, host B/param, peaks), OUT/plan-*.txt, and with
# part resident (after 20b) OUT/resident-lora-<tag>.json and OUT/ratio-20b.txt. Each part is one
# command: BUDGET (s, default 570) bounds each, STEPS (default 4) the steps of each run, LIMIT (s, default
# 600) each bench run (a whole-model start draws and quantizes the ~117B base first: run such a part
# detached across calls, `setsid nohup env BUDGET=1200 LIMIT=1200 bash benchmarks/gpt_oss.sh OUT 120b-262k &`).
# MICRO_BATCHES (default 16) splits each bench run's step otherwise (`plan` advises splits: e.g. 1, the
# 65,536 tokens in one micro-batch of 16 sequences); a run of another split is tagged -mbN.
source "$(dirname "$0")/lib.sh"
parts=${2:-plan 120b-65k 120b-262k air-65k air-262k 20b resident}
rc=0
LORA=(--set lora.rank=16 --set lora.alpha=32 --set lora.target_modules=q_proj,k_proj,v_proj,o_proj)
mb=${MICRO_BATCHES:-16}; sfx=$( (( mb == 16 )) || echo "-mb$mb")
steps=(--seq-len 4096 --micro-batches "$mb" --steps "${STEPS:-4}")
# plan_real PRESET BASE: the plan of the preset's whole shape for one H200 and 128 GiB at 262,144 tokens a step
# (exit status 2 where it does not fit this machine)
plan_real() {
  run "plan-$1" 120 python3 -m megatrain_ray.cli plan --device cuda --gpu-memory 139 --host-memory 125 \
    $(shape_args "$1") "${LORA[@]}" --set lora.base_format="$2" --set model.max_position_embeddings=4096 \
    --set train.seq_len=4096 --set train.micro_batch_size=4 --set train.num_micro_batches=16
}
if smoke; then
  # the real shapes' plans as the GPU part runs them (arithmetic only): their /dev/shm may not fit here
  for p in "gpt-oss-120b mxfp4" "glm-4.5-air nf4"; do
    plan_real $p || { r=$?; (( r == 2 )) || rc=$r; }
  done
  tiny=(--layers 2 --tokens 1024 --seq-len 128 --micro-batches 2 --steps 3 --set compute.device=cpu
        --set model.hidden_size=64 --set model.num_attention_heads=4 --set model.num_key_value_heads=2
        --set model.head_dim=16 --set model.vocab_size=260 --set model.num_experts=4 --set model.num_experts_per_tok=2
        --set lora.rank=4 --set lora.target_modules=q_proj,k_proj,v_proj,o_proj)
  bench gpt-oss-tiny-mxfp4 300 --preset gpt-oss-20b "${tiny[@]}" --set model.intermediate_size=64 \
    --set lora.base_format=mxfp4
  bench glm-tiny-nf4 300 --preset glm-4.5-air "${tiny[@]}" --set model.intermediate_size=128 \
    --set model.moe_intermediate_size=32 --set lora.base_format=nf4
  stamp done; exit $rc
fi
case " $parts " in *" plan "*)
  for p in "gpt-oss-120b mxfp4" "glm-4.5-air nf4"; do
    set -- $p
    plan_real "$1" "$2" || rc=$?
    cp "$out/log_plan-$1.txt" "$out/plan-$1.txt"; grep "LoRA\|frozen base" "$out/plan-$1.txt"
  done ;;
esac
for row in "120b-65k gpt-oss-120b mxfp4 65536" "120b-262k gpt-oss-120b mxfp4 262144" \
           "air-65k glm-4.5-air nf4 65536" "air-262k glm-4.5-air nf4 262144" "20b gpt-oss-20b mxfp4 65536"; do
  read -r part preset base tokens <<< "$row"
  case " $parts " in *" $part "*)
    bench "$preset-$base-$tokens$sfx" "$(left "${LIMIT:-600}")" --preset "$preset" --tokens "$tokens" "${steps[@]}" "${LORA[@]}" \
      --set lora.base_format="$base" ;;
  esac
done
case " $parts " in *" resident "*)  # transformers + peft resident, experts bf16: all 24 layers, or the most that fit
  run resident-lora-20b "$(left 600)" python3 benchmarks/lora_resident.py --preset gpt-oss-20b --layers 24 --rank 16 \
    --targets q_proj,k_proj,v_proj,o_proj --tokens 65536 --seq-len 4096 --micro-batches "$mb" --steps "${STEPS:-4}" \
    --tag "gpt-oss-20b-65536$sfx" --out "$out" || rc=$?
  grep "^resident-lora" "$out/log_resident-lora-20b.txt"
  lora_ratio "$out/ratio-20b$sfx.txt" "$out/bench-gpt-oss-20b-mxfp4-65536$sfx.json" "$out/resident-lora-gpt-oss-20b-65536$sfx.json" \
    || rc=$? ;;
esac
stamp done; exit $rc
