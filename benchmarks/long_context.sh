#!/usr/bin/env bash
# What do the long-context paths train at, against what `megatrain-ray plan` expects?
#   512k: configs/long-context-512k.yaml as written (the whole Qwen2.5-7B shape on one 524,288-token
#         sequence, 8-bit AdamW state), one step through `megatrain-ray train`: its data
#         replaced by a pre-tokenized .npy made here (random ids), nothing else changed but
#         the step count (1, so no warmup), checkpoints and the final export off. A step takes ~9 minutes.
#   1m:   one 1,048,576-token sequence through the 7B width at 4 layers (`megatrain-ray bench`),
#         two steps (the first compiles), ~5 minutes each; STEPS=1: its one step, compile included.
# Each part runs detached (setsid), longer than one device call may last; collect afterwards:
#   bash benchmarks/long_context.sh OUT start 512k     # returns at once; the run goes on
#   bash benchmarks/long_context.sh OUT collect        # running or done; the table of what is done
#   bash benchmarks/long_context.sh OUT run 512k       # the same in the foreground
#   SMOKE=1 bash benchmarks/long_context.sh OUT run 512k   # the CPU, the config at a tiny shape
# Writes OUT/<part>/: the plan (plan.txt), the run's log, metrics.jsonl (512k) or bench-<tag>.json
# (1m), memory samples every 5 s (host used, GPU used: mem.tsv), rc; `collect` prints per part:
# s/step, tokens/s, TFLOPS (6·N·T and counting attention), GPU and host peaks, and the plan's
# expected step time, GPU total and placement beside them.
source "$(dirname "$0")/lib.sh"
mode=${2:-collect}
part=${3:-512k}
[[ $part == 512k || $part == 1m ]] || { echo "part must be 512k or 1m, got $part"; exit 2; }
dir="$out/$part"

tiny=(--set model.hidden_size=64 --set model.intermediate_size=176 --set model.num_hidden_layers=2
      --set model.num_attention_heads=4 --set model.num_key_value_heads=2 --set model.vocab_size=512
      --set train.seq_len=2048 --set model.max_position_embeddings=2048 --set memory.mlp_chunk_size=512
      --set memory.loss_chunk_size=512 --set compute.device=cpu)
shape_1m=(--set model.model_type=qwen2 --set model.vocab_size=152064 --set model.hidden_size=3584
          --set model.intermediate_size=18944 --set model.num_hidden_layers=4 --set model.num_attention_heads=28
          --set model.num_key_value_heads=4 --set model.rope_theta=1000000.0 --set train.seq_len=1048576
          --set train.micro_batch_size=1 --set train.num_micro_batches=1 --set memory.mlp_chunk_size=16384
          --set model.max_position_embeddings=1048576 --set train.save_final=false)

sample_memory() {  # host used (MemTotal - MemAvailable) and GPU used, every 5 s, until the run ends
  echo -e "t_s\thost_used_gib\tgpu_used_gib" > "$dir/mem.tsv"
  while [ ! -f "$dir/rc" ]; do
    host=$(awk '/MemTotal/ {t=$2} /MemAvailable/ {a=$2} END {printf "%.2f", (t - a) / 1048576}' /proc/meminfo)
    gpu=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1)
    echo -e "$(( $(date +%s) - t0 ))\t$host\t$(awk -v m="${gpu:-0}" 'BEGIN {printf "%.2f", m / 1024}')" >> "$dir/mem.tsv"
    sleep 5
  done
}

run_512k() {
  local vocab=152064 tokens=600000
  smoke && { vocab=512; tokens=20000; }
  python3 -c "import numpy as np, sys; np.save(sys.argv[1], np.random.default_rng(0).integers(0, $vocab, $tokens))" \
    "$dir/tokens.npy"
  local data=(--set "data.path=$dir/tokens.npy" --set data.format=auto --set data.tokenizer=null
              --set train.steps=1 --set optim.warmup_steps=0 --set train.checkpoint_every=0 --set train.save_final=false
              --set "train.run_dir=$dir/runs")
  smoke && data+=("${tiny[@]}")
  python3 -m megatrain_ray.cli plan --config configs/long-context-512k.yaml "${data[@]}" > "$dir/plan.txt" 2>&1
  python3 -m megatrain_ray.cli train --config configs/long-context-512k.yaml "${data[@]}" > "$dir/log.txt" 2>&1
}

run_1m() {
  local args=(--preset 7b --layers 4 --tokens 1048576 --seq-len 1048576 --micro-batches 1 --steps "${STEPS:-2}"
              --set memory.mlp_chunk_size=16384 --set model.max_position_embeddings=1048576)
  smoke && args=("${SMOKE_ARGS[@]}")
  local plan_args=("${shape_1m[@]}")
  smoke && plan_args=("${tiny[@]}")
  python3 -m megatrain_ray.cli plan "${plan_args[@]}" > "$dir/plan.txt" 2>&1
  python3 -m megatrain_ray.cli bench "${args[@]}" --tag "7b-4l-1m" --out "$dir" > "$dir/log.txt" 2>&1
}

case $mode in
  start)
    mkdir -p "$dir"; rm -f "$dir/rc"
    setsid nohup bash "$PWD/benchmarks/long_context.sh" "$out" run "$part" > "$dir/driver.txt" 2>&1 < /dev/null &
    echo "started $part (process group $!): bash benchmarks/long_context.sh $out collect";;
  run)
    mkdir -p "$dir"; rm -f "$dir/rc"
    stamp "$part"
    sample_memory & sampler=$!
    "run_$part"; echo $? > "$dir/rc"
    wait $sampler
    stamp "done: rc=$(cat "$dir/rc")"
    exit "$(cat "$dir/rc")";;
  collect)
    python3 - "$out" <<'PY'
import glob, json, os, re, sys

out = sys.argv[1]
print(f"{'part':<6}{'state':<10}{'s/step':>9}{'tok/s':>9}{'TFLOPS 6NT':>11}{'TFLOPS attn':>12}{'GPU GiB':>9}"
      f"{'host GiB':>9}  plan: expected step, GPU total, placement")
for part in ("512k", "1m"):
    d = os.path.join(out, part)
    if not os.path.isdir(d):
        continue
    rc = open(os.path.join(d, "rc")).read().strip() if os.path.exists(os.path.join(d, "rc")) else None
    state = "running" if rc is None else ("done" if rc == "0" else f"rc={rc}")
    row = {}
    if part == "512k":
        metrics = glob.glob(os.path.join(d, "runs", "*", "metrics.jsonl"))
        rows = [json.loads(x) for x in open(metrics[0])] if metrics else []
        if rows:
            r = rows[-1]
            row = {"s": r["step_s"], "tps": r["tokens_per_s"], "6nt": r["tflops_6nt"], "palm": r["tflops_palm"],
                   "gpu": r.get("device_peak_bytes", 0) / 2**30}
    else:
        reports = glob.glob(os.path.join(d, "bench-*.json"))
        if reports:
            r = json.load(open(reports[0]))["systems"]["megatrain_ray"]
            row = {"s": r["step_s"], "tps": r["tokens_per_s"], "6nt": r.get("tflops_6nt"), "palm": r.get("tflops_palm"),
                   "gpu": r.get("device_peak_gib"), "added": r.get("host_peak_added_gib")}
    mem = os.path.join(d, "mem.tsv")
    if os.path.exists(mem):
        samples = [line.split("\t") for line in open(mem).read().splitlines()[1:]]
        if samples:
            row["host"] = max(float(s[1]) for s in samples)
            row.setdefault("gpu_smi", max(float(s[2]) for s in samples))
    plan = open(os.path.join(d, "plan.txt")).read() if os.path.exists(os.path.join(d, "plan.txt")) else ""
    expected = re.search(r"^expected step time: (~\S+ \S+)", plan, re.M)
    gpu_total = re.search(r"^total GPU\s+(\S+ GiB)", plan, re.M)
    placed = re.search(r"^activations \([^)]*\): (.*)$", plan, re.M)
    fmt = lambda k, spec: format(row[k], spec) if row.get(k) is not None else format("-", spec[:2])
    print(f"{part:<6}{state:<10}{fmt('s', '>9.1f')}{fmt('tps', '>9,.0f')}{fmt('6nt', '>11.1f')}{fmt('palm', '>12.1f')}"
          f"{fmt('gpu', '>9.1f')}{fmt('host', '>9.1f')}  {expected.group(1) if expected else '?'}, "
          f"{gpu_total.group(1) if gpu_total else '?'}, {placed.group(1)[:110] if placed else '?'}")
    if rc not in (None, "0"):
        log = os.path.join(d, "log.txt")
        tail = open(log).read().strip().splitlines()[-3:] if os.path.exists(log) else []
        print("      " + "\n      ".join(tail))
PY
    ;;
  *) echo "mode must be start, run or collect, got $mode"; exit 2;;
esac
