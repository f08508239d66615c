#!/usr/bin/env bash
# What does LoRA train at on one GPU over a 4-bit frozen base (lora.base_format=nf4: held and streamed as
# nf4, dequantized on the GPU), and how large a base does this host hold? The GPU check first (the
# dequantization on the GPU is the CPU's bit for bit, its time per layer, a small nf4 LoRA run on cuda);
# then the plans of both shapes in each base format; then the Qwen3-30B-A3B shape whole (48 layers,
# 30.5B) with rank-16 adapters, nf4 base, 262,144 tokens a step (16 micro-batches of 4 x 4,096; needs
# LoRA on mixtures of experts), and the Llama-3.1-70B shape (80 layers, hidden 8192) with rank-16
# adapters, nf4 base, 65,536 tokens a step (16 x 4 x 1,024), 10 steps.
#   bash benchmarks/qlora.sh OUT [PARTS]   # one H200, 128 GiB; PARTS: any of "check plan qwen3 resident 70b"
#   bash benchmarks/qlora.sh OUT start70b  # the 70b part detached (setsid): returns at once
#   bash benchmarks/qlora.sh OUT collect   # the detached run: running or done, its steps and figures
#   SMOKE=1 bash benchmarks/qlora.sh OUT   # the CPU, the tiny preset
# Writes OUT/bench-<tag>.json (megatrain-ray bench: s/step, tokens/s, TFLOPS, GPU busy, link GB/s, host
# B/param), OUT/plan-*.txt and OUT/log_gpu-check.txt; part resident (after qwen3): transformers + peft +
# bitsandbytes 4-bit resident on the GPU on the same shape, as many layers as fit (lora_resident.py --base
# nf4: its nn.Linear layers in NF4, the fused experts bf16 as transformers leaves them), and
# OUT/ratio-nf4.txt, the tokens/s per layer of the two. BUDGET (s, default 570) is per command, STEPS (default 4)
# the steps of each of those two runs (the first one's compile excluded from s/step); the 70B
# run's 10 steps take longer than one 10-minute call at ~400 TFLOPS (about 70 s a step), so it runs
# detached across calls: STEPS70 (default 10) sets them, BUDGET70 (default 3000) its limit. It trains
# on real text, byte by byte (data.format windows over OUT/text.txt: this repository's documents and
# the installed Python packages' descriptions, English prose) at a LoRA learning rate (1e-3), so that its
# loss is seen to fall.
source "$(dirname "$0")/lib.sh"
parts=${2:-check plan qwen3 resident 70b}
rc=0
QLORA=(--set lora.rank=16 --set lora.alpha=32 --set lora.base_format=nf4)
if smoke; then
  bench qlora-tiny 300 "${SMOKE_ARGS[@]}" --set lora.rank=4 --set lora.base_format=nf4
  run plan-qlora-tiny 120 python3 -m megatrain_ray.cli plan --device cpu $(shape_args tiny 2) --set lora.rank=4 \
    --set lora.base_format=nf4 || rc=$?
  run resident-qlora-tiny 300 python3 benchmarks/lora_resident.py --preset tiny --layers 1 --tokens 1024 \
    --seq-len 128 --micro-batches 2 --steps 2 --rank 4 --device cpu --base nf4 --tag tiny-nf4 --out "$out" || rc=$?
  lora_ratio "$out/ratio-nf4.txt" "$out/bench-qlora-tiny.json" "$out/resident-lora-tiny-nf4.json" || rc=$?
  stamp done; exit $rc
fi
case " $parts " in *" check "*)
  run gpu-check 600 python3 -m pytest -q -s tests/test_gpu_quant.py || rc=$?
  grep -E "dequantized|losses|over the link|passed|failed" "$out/log_gpu-check.txt" ;;
esac
case " $parts " in *" plan "*)
  run plan-qlora-qwen3 120 python3 -m megatrain_ray.cli plan --device cuda $(shape_args qwen3-30b-a3b) "${QLORA[@]}" \
    --set model.max_position_embeddings=4096 --set train.seq_len=4096 --set train.micro_batch_size=4 --set train.num_micro_batches=16 || rc=$?
  run plan-qlora-70b 120 python3 -m megatrain_ray.cli plan --device cuda $(shape_args 70b) "${QLORA[@]}" \
    --set train.seq_len=1024 --set train.micro_batch_size=4 --set train.num_micro_batches=16 || rc=$?
  for p in qwen3 70b; do cp "$out/log_plan-qlora-$p.txt" "$out/plan-qlora-$p.txt"; grep "LoRA\|frozen base" \
    "$out/plan-qlora-$p.txt"; done ;;
esac
case " $parts " in *" qwen3 "*)
  bench qlora-qwen3-30b-a3b-nf4-262144 "$(left 600)" --preset qwen3-30b-a3b --tokens 262144 --seq-len 4096 \
    --micro-batches 16 --steps "${STEPS:-4}" "${QLORA[@]}" ;;
esac
case " $parts " in *" resident "*)  # transformers + peft + bitsandbytes 4-bit resident, as many layers as fit
  run resident-qlora-moe "$(left 600)" python3 benchmarks/lora_resident.py --preset qwen3-30b-a3b --layers 48 --rank 16 \
    --targets q_proj,k_proj,v_proj,o_proj --tokens 262144 --seq-len 4096 --micro-batches 16 --steps "${STEPS:-4}" --base nf4 \
    --tag qwen3-30b-a3b-nf4-262144 --out "$out" || rc=$?
  grep "^resident-lora" "$out/log_resident-qlora-moe.txt"
  lora_ratio "$out/ratio-nf4.txt" "$out/bench-qlora-qwen3-30b-a3b-nf4-262144.json" \
    "$out/resident-lora-qwen3-30b-a3b-nf4-262144.json" || rc=$? ;;
esac
case " $parts " in *" start70b "*)
  setsid nohup bash "$PWD/benchmarks/qlora.sh" "$out" 70b > "$out/driver70b.txt" 2>&1 < /dev/null &
  echo "started the 70b part (process group $!): bash benchmarks/qlora.sh $out collect"; exit 0 ;;
esac
case " $parts " in *" collect "*)
  python3 - "$out" <<'PY'
import glob, json, os, re, sys

out = sys.argv[1]
log = os.path.join(out, "log_qlora-70b-nf4-65536.txt")
text = open(log).read() if os.path.exists(log) else ""
done = re.search(r"^rc=(\d+)$", text, re.M)
print("70b:", "not started" if not text else ("running" if not done else f"done, rc={done.group(1)}"))
for line in re.findall(r"^\s*step\s+\d+/\d+ \|.*$", text, re.M):
    print(" ", line.strip())
for report in glob.glob(os.path.join(out, "bench-qlora-70b-*.json")):
    r = json.load(open(report))["systems"]["megatrain_ray"]
    print(f"  s/step {r['step_s']:.3f}, tokens/s {r['tokens_per_s']:,.0f}, TFLOPS 6·N·T {r['tflops_6nt']:.1f} / PaLM "
          f"{r['tflops_palm']:.1f}, compute {100 * r['compute_busy_frac']:.0f}% of the step, GPU {r['device_peak_gib']:.1f} GiB, "
          f"host {r['host_bytes_per_param']:.2f} B/param, losses {[round(x, 4) for x in r['losses']]}")
if done and done.group(1) != "0":
    print("  " + "\n  ".join(text.strip().splitlines()[-3:]))
PY
  exit 0 ;;
esac
case " $parts " in *" 70b "*)
  real_text "$out/text.txt" 16
  BUDGET=${BUDGET70:-3000} bench qlora-70b-nf4-65536 "$(BUDGET=${BUDGET70:-3000} left 3000)" --preset 70b \
    --tokens 65536 --seq-len 1024 --micro-batches 16 --steps "${STEPS70:-10}" "${QLORA[@]}" \
    --set "data.path=$out/text.txt" --set data.format=windows --set optim.lr=1e-3 ;;  # LoRA's usual rate, not bench's 1e-4
esac
stamp done; exit $rc
