#!/usr/bin/env bash
# Checkpoint cost on the device box (issue 14: snapshot checkpoints without pausing the sink).
# 1. benchmarks/checkpoint_cost.py: this machine's CRC-32, copy and write rates, a background save
#    against a simulated 7B sink, and the 7B estimate (4 layers of the 7B shape, full vocabulary:
#    2.0 B parameters, a 24 GB checkpoint written twice, one at a time).
# 2. A real run under Ray on the GPU: the 7B shape cut to 4 layers and a 32k vocabulary (1.2 B
#    parameters, 14 GB checkpoints), 65,536 tokens a step, a checkpoint every 4 steps (4, 8 and the
#    end, 10): what each save took, what the sink waited, and the step times around the saves.
#   bash benchmarks/h200_ckpt.sh $OUT          (about 5 minutes on one H200; ~40 GB of disk at peak)
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
stamp "checkpoint_cost"
timeout 300 python3 benchmarks/checkpoint_cost.py "$out/cost" --layers 4 --vocab 152064 --dir /tmp/ckpt-cost \
  > "$out/log_cost.txt" 2>&1
echo "rc=$?" >> "$out/log_cost.txt"
rm -rf /tmp/ckpt-cost
stamp "checkpoint_cost, 16 GiB staging"
timeout 300 python3 benchmarks/checkpoint_cost.py "$out/cost-staged" --layers 4 --vocab 152064 --dir /tmp/ckpt-cost \
  --staging-gib 16 > "$out/log_cost_staged.txt" 2>&1
echo "rc=$?" >> "$out/log_cost_staged.txt"
rm -rf /tmp/ckpt-cost
stamp "train with checkpoints"
timeout 420 python3 -m megatrain_ray.cli train --config configs/qwen2.5-7b.yaml \
  --set model.num_hidden_layers=4 --set model.vocab_size=32000 --set data.path=null --set data.tokenizer=null \
  --set data.num_workers=1 --set train.steps=10 --set train.checkpoint_every=4 --set train.keep_checkpoints=1 \
  --set train.save_final=false --set optim.warmup_steps=2 --set runtime.run_dir=/tmp/ckpt-runs \
  > "$out/log_train.txt" 2>&1
echo "rc=$?" >> "$out/log_train.txt"
python3 - "$out" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
runs = sorted(glob.glob("/tmp/ckpt-runs/*/metrics.jsonl"))
rows = [json.loads(line) for line in open(runs[-1])] if runs else []
print("step  step_s")
for r in rows:
    print(f"{r['step'] + 1:>4}  {r['step_s']:.3f}")
print("".join(line for line in open(os.path.join(out, "log_train.txt")) if line.startswith(("checkpoint:", "error", "rc="))))
EOF
rm -rf /tmp/ckpt-runs
tail -10 "$out/log_cost.txt"; grep -E "background|rc=" "$out/log_cost_staged.txt"
stamp done
