# Shared by the recipes (source it): the output folder, a clock, what the machine and code are, smoke mode.
#   out=$1 (default /tmp/out); SMOKE=1: the same steps on the CPU at a tiny shape (what the tests run).
set -uo pipefail
out=${1:-/tmp/out}; mkdir -p "$out"; out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1  # the repository root: python -m megatrain_ray, benchmarks/*.py
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
left() { local l=$(( ${BUDGET:-570} - ($(date +%s) - t0) )); (( l > $1 )) && l=$1; (( l < 10 )) && l=10; echo $l; }
smoke() { [ "${SMOKE:-0}" = 1 ]; }
# The step shape and device of a smoke run: a 2-layer tiny model on the CPU, 1,024 tokens a step.
SMOKE_ARGS=(--preset tiny --layers 2 --tokens 1024 --seq-len 128 --micro-batches 2 --steps 3 --set compute.device=cpu)
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with local changes)')"
  echo "cpus: $(nproc), memory: $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
  python3 -c "import torch, ray; print(f'torch {torch.__version__}, ray {ray.__version__}')" 2>/dev/null
} > "$out/machine.txt"
# run TAG TIMEOUT COMMAND...: the command's output to OUT/log_TAG.txt and its exit status at the end
run() {
  local tag=$1 limit=$2; shift 2
  stamp "$tag"
  timeout "$limit" "$@" > "$out/log_$tag.txt" 2>&1; local rc=$?
  echo "rc=$rc" >> "$out/log_$tag.txt"
  (( rc == 0 )) || { echo "$tag failed (rc=$rc): see $out/log_$tag.txt"; tail -5 "$out/log_$tag.txt"; }
  return $rc
}
# bench TAG TIMEOUT ARGS...: one megatrain-ray bench run (a failure's status into rc), then its table
bench() {
  local tag=$1 limit=$2; shift 2
  run "$tag" "$limit" python3 -m megatrain_ray.cli bench "$@" --tag "$tag" --out "$out" || rc=$?
  grep -A3 "^system" "$out/log_$tag.txt" 2>/dev/null
}
# plan_layers FILE MODE: how many layers of the planned shape the plan printed in FILE says MODE fits
# (MODE: the start of its row, e.g. "compact (optim.state 8bit)" or "LoRA"); empty if it has no such row
plan_layers() { sed -n "s/^  $2.*(\([0-9]*\) layer(s) of this shape.*/\1/p" "$1"; }
# shape_args PRESET [LAYERS]: the --set model.* words of a preset's shape (cut to LAYERS decoder layers);
# a mapping's value (gpt-oss's rope_scaling) as JSON without spaces, so that it stays one word
shape_args() {
  python3 -c "import json; from megatrain_ray.model.presets import preset_shape as p; print(' '.join(f'--set model.{k}=' + (json.dumps(v, separators=(',', ':')) if isinstance(v, (dict, list)) else str(v)) for k, v in p('$1', ${2:-None}).items()))"
}
# real_text FILE MiB: English prose on any machine, offline: this repository's documents, then the
# installed Python packages' descriptions (METADATA) and READMEs, concatenated up to MiB mebibytes.
real_text() {
  python3 - "$1" "$2" <<'PY'
import glob, os, site, sys

path, limit = sys.argv[1], int(sys.argv[2]) * 2**20
roots = [os.getcwd()] + site.getsitepackages()
files = sorted(glob.glob(os.path.join(roots[0], "**", "*.md"), recursive=True))
for root in roots[1:]:
    files += sorted(glob.glob(os.path.join(root, "*.dist-info", "METADATA")))
    files += sorted(glob.glob(os.path.join(root, "**", "README*"), recursive=True))
size = 0
with open(path, "wb") as out:
    for f in files:
        if size >= limit or not os.path.isfile(f):
            continue
        data = open(f, "rb").read()
        if data and sum(b < 128 for b in data) > 0.95 * len(data):  # prose, not binaries or other scripts
            out.write(data[:limit - size] + b"\n\n")
            size += min(len(data), limit - size) + 2
print(f"{path}: {size / 2**20:.1f} MiB of text from {len(files)} files")
PY
}
# lora_ratio FILE OURS_JSON THEIRS_JSON: our tokens/s per layer (a bench JSON) over a resident LoRA run's
# (lora_resident.py's JSON), printed and written to FILE
lora_ratio() {
  python3 - "$2" "$3" <<'PY' | tee "$1"
import json, sys
ours, theirs = (json.load(open(p)) for p in sys.argv[1:3])
mine = ours["systems"]["megatrain_ray"]["tokens_per_s"] * ours["layers"]
print(f"tokens/s per layer: ours {mine:,.0f} ({ours['layers']} layers), transformers + peft resident "
      f"({theirs.get('base', 'bf16')} base) {theirs['layer_tokens_per_s']:,.0f} ({theirs['layers']} layers): "
      f"{mine / theirs['layer_tokens_per_s']:.2f}x")
PY
}
