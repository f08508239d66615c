#!/usr/bin/env bash
# What do mixtures of experts train at on one GPU, at 262,144 and 65,536 tokens a step, beside a
# GPU-resident transformers run of the same MoE layers? The Qwen3-30B-A3B shape with 12 of its 48
# layers (fp32 master, exact AdamW) and with as many layers as the plan fits for optim.state=8bit (up
# to 40), the Mixtral-8x7B shape with 6 of its 32 layers (exact); sequences of 4,096 tokens. And
# does a sparse layer cross the link as fast as a dense layer of the same bytes (part "link",
# benchmarks/moe_link.py: h2d and d2h GB/s of one layer's copies, every expert routed and some idle)?
#   bash benchmarks/moe.sh OUT [PARTS]   # one H200, 128 GiB; PARTS: any of "link qwen3 qwen3-8bit mixtral resident"
#   SMOKE=1 bash benchmarks/moe.sh OUT   # the CPU, the small-moe preset, a resident run of 1 layer
# Writes OUT/bench-<tag>.json (megatrain-ray bench: s/step, tokens/s, TFLOPS as 6·N_active·T and PaLM,
# GPU busy, link GB/s each way, the CPU update's time, host B/param), OUT/resident-<tag>.json,
# OUT/plan-qwen3-8bit.txt and OUT/moe-link-<preset>.json. Each bench run is its own command: BUDGET
# (s, default 570) is per command.
source "$(dirname "$0")/lib.sh"
parts=${2:-link qwen3 qwen3-8bit mixtral resident}
rc=0
if smoke; then
  bench moe-tiny 300 --preset small-moe --layers 2 --tokens 1024 --seq-len 128 --micro-batches 2 --steps 3 \
    --set compute.device=cpu
  run resident-tiny 300 python3 benchmarks/moe_resident.py --preset small-moe --layers 1 --tokens 1024 --seq-len 128 \
    --micro-batches 2 --steps 2 --device cpu --tag tiny --out "$out" || rc=$?
  grep "^resident" "$out/log_resident-tiny.txt"
  run moe-link-tiny 120 python3 benchmarks/moe_link.py --preset small-moe --device cpu --reps 3 --out "$out" || rc=$?
  grep "^link\|^every" "$out/log_moe-link-tiny.txt"
  stamp done; exit $rc
fi
case " $parts " in *" link "*)
  for preset in qwen3-30b-a3b mixtral-8x7b; do
    run "moe-link-$preset" 300 python3 benchmarks/moe_link.py --preset "$preset" --out "$out" || rc=$?
    grep "^link\|^every" "$out/log_moe-link-$preset.txt"
  done ;;
esac
step=(--seq-len 4096 --steps 4)
for tokens in 262144 65536; do
  mbs=$(( tokens / 4096 / 4 ))  # 4 sequences per micro-batch
  case " $parts " in *" qwen3 "*)
    bench "qwen3-30b-a3b-12l-$tokens" "$(left 600)" --preset qwen3-30b-a3b --layers 12 --tokens "$tokens" \
      --micro-batches "$mbs" "${step[@]}" ;;
  esac
  case " $parts " in *" qwen3-8bit "*)
    run plan-qwen3-8bit 120 python3 -m megatrain_ray.cli plan --device cuda --set optim.state=8bit \
      $(shape_args qwen3-30b-a3b 12) \
      --set train.seq_len=4096 --set train.micro_batch_size=4 --set "train.num_micro_batches=$mbs"
    cp "$out/log_plan-qwen3-8bit.txt" "$out/plan-qwen3-8bit.txt"
    fits=$(plan_layers "$out/plan-qwen3-8bit.txt" "compact (optim.state 8bit)")
    layers=$(( ${fits:-40} < 40 ? ${fits:-40} : 40 ))
    echo "optim.state=8bit: the plan fits $fits layers of the Qwen3-30B-A3B shape; running $layers"
    bench "qwen3-30b-a3b-${layers}l-8bit-$tokens" "$(left 600)" --preset qwen3-30b-a3b --layers "$layers" \
      --tokens "$tokens" --micro-batches "$mbs" "${step[@]}" --set optim.state=8bit ;;
  esac
  case " $parts " in *" mixtral "*)
    bench "mixtral-8x7b-6l-$tokens" "$(left 600)" --preset mixtral-8x7b --layers 6 --tokens "$tokens" \
      --micro-batches "$mbs" "${step[@]}" ;;
  esac
  case " $parts " in *" resident "*)
    for preset in qwen3-30b-a3b mixtral-8x7b; do  # as many of the same layers as fit the GPU resident
      first=$([ "$preset" = qwen3-30b-a3b ] && echo 10 || echo 4)
      run "resident-$preset-$tokens" "$(left 600)" python3 benchmarks/moe_resident.py --preset "$preset" \
        --layers "$first" --tokens "$tokens" --micro-batches "$mbs" --seq-len 4096 --tag "$preset-$tokens" \
        --out "$out" || rc=$?
      grep "^resident" "$out/log_resident-$preset-$tokens.txt"
    done ;;
  esac
done
stamp done; exit $rc
