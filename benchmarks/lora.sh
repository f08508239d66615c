#!/usr/bin/env bash
# What does LoRA on a streamed frozen base train at on one GPU, beside full fine-tuning of the same
# shape and a GPU-resident transformers + peft run? The Qwen2.5-32B shape (32.8B parameters; its bf16
# base is 66 GB) with rank-16 adapters on every linear layer, 65,536 tokens a step (16 micro-batches
# of 4 x 1,024); full fine-tuning with the compact state (optim.state=8bit) at as many layers as the
# plan fits; the resident peft run at as many layers as fit the GPU; and a LoRA run near the largest
# base the plan says this host holds (the 32B width, more layers).
#   bash benchmarks/lora.sh OUT [PARTS]   # one H200, 128 GiB; PARTS: any of "plan lora full resident largest"
#   SMOKE=1 bash benchmarks/lora.sh OUT   # the CPU, the tiny preset, a resident run of 1 layer
# Writes OUT/bench-<tag>.json (megatrain-ray bench: s/step, tokens/s, TFLOPS in both conventions as a
# LoRA step runs them, GPU busy, link GB/s, host B/param), OUT/resident-lora-<tag>.json and
# OUT/plan-*.txt. Each run is its own command: BUDGET (s, default 570) is per command.
source "$(dirname "$0")/lib.sh"
parts=${2:-plan lora full resident largest}
rc=0
LORA=(--set lora.rank=16 --set lora.alpha=32)
if smoke; then
  bench lora-tiny 300 "${SMOKE_ARGS[@]}" --set lora.rank=4
  run plan-lora-tiny 120 python3 -m megatrain_ray.cli plan --device cpu $(shape_args tiny 2) --set lora.rank=4 || rc=$?
  run resident-lora-tiny 300 python3 benchmarks/lora_resident.py --preset tiny --layers 1 --tokens 1024 --seq-len 128 \
    --micro-batches 2 --steps 2 --rank 4 --device cpu --tag tiny --out "$out" || rc=$?
  grep "^resident-lora" "$out/log_resident-lora-tiny.txt"
  stamp done; exit $rc
fi
step=(--tokens 65536 --seq-len 1024 --micro-batches 16 --steps 4)
plan_set=(--set train.seq_len=1024 --set train.micro_batch_size=4 --set train.num_micro_batches=16)
case " $parts " in *" plan "*|*" largest "*)
  run plan-lora-32b 120 python3 -m megatrain_ray.cli plan --device cuda $(shape_args 32b 64) "${LORA[@]}" \
    "${plan_set[@]}" || rc=$?
  cp "$out/log_plan-lora-32b.txt" "$out/plan-lora-32b.txt" ;;
esac
case " $parts " in *" lora "*)
  bench lora-32b-r16-65536 "$(left 600)" --preset 32b "${step[@]}" "${LORA[@]}" ;;
esac
case " $parts " in *" full "*)
  run plan-full-32b-8bit 120 python3 -m megatrain_ray.cli plan --device cuda $(shape_args 32b 64) \
    --set optim.state=8bit "${plan_set[@]}" || rc=$?
  cp "$out/log_plan-full-32b-8bit.txt" "$out/plan-full-32b-8bit.txt"
  fits=$(plan_layers "$out/plan-full-32b-8bit.txt" "compact (optim.state 8bit)")
  layers=$(( ${fits:-48} < 64 ? ${fits:-48} : 64 ))
  echo "optim.state=8bit: the plan fits ${fits:-?} layers of the Qwen2.5-32B shape; running $layers"
  bench "full-32b-${layers}l-8bit-65536" "$(left 600)" --preset 32b --layers "$layers" "${step[@]}" \
    --set optim.state=8bit ;;
esac
case " $parts " in *" resident "*)
  run resident-lora-32b 600 python3 benchmarks/lora_resident.py --preset 32b --layers 64 --rank 16 --tokens 65536 \
    --seq-len 1024 --micro-batches 16 --tag 32b-65536 --out "$out" || rc=$?
  grep "^resident-lora" "$out/log_resident-lora-32b.txt" ;;
esac
case " $parts " in *" largest "*)  # the largest LoRA base of the 32B width the plan says this host holds
  fits=$(plan_layers "$out/plan-lora-32b.txt" "LoRA (lora.rank > 0: a frozen base, compute)")
  layers=$(( ${fits:-96} - 2 ))
  echo "LoRA: the plan fits ${fits:-?} layers of the 32B width; running $layers"
  bench "lora-32bw-${layers}l-r16-65536" "$(left 600)" --preset 32b --layers "$layers" "${step[@]}" "${LORA[@]}" ;;
esac
stamp done; exit $rc
