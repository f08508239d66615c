#!/usr/bin/env bash
# The 7B benchmark of two versions of the code on one machine in one device call: the code of an
# older commit (a folder holding its tree) and the current tree, one after the other, with the same
# settings; then their s/step and GPU peak side by side, and the new one's difference in percent.
#
#   bash benchmarks/code_side_by_side.sh OUT OLD_TREE [SETTINGS...]
#
# OLD_TREE: a folder with the old commit's files, made before the device call so it travels with
# the working tree (an untracked folder that git does not ignore), e.g. for main at 695dfc0:
#   git archive 695dfc0 --prefix=old_tree/ | tar -x && bash benchmarks/code_side_by_side.sh $OUT old_tree
# or, where the device machine has the repository's history, a commit (it is extracted to OUT/old).
# SETTINGS are passed to `megatrain_ray.bench --preset 7b --steps 6` as they are (none: the
# defaults). Each run gets at most 280 s of the BUDGET seconds (default 580).
set -uo pipefail
out=${1:?usage: code_side_by_side.sh OUT OLD_TREE_OR_COMMIT [SETTINGS...]}; old=${2:?old tree or commit}; shift 2
mkdir -p "$out"
here=$(pwd)
if [ ! -d "$old" ]; then
  git archive "$old" --prefix=old/ | tar -x -C "$out" || { echo "cannot extract commit $old"; exit 2; }
  old="$out/old"
fi
old=$(cd "$old" && pwd)
export PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
for tag in old new; do
  src=$here; [ "$tag" = old ] && src=$old
  left=$(( ${BUDGET:-580} - ($(date +%s) - t0) )); (( left > 280 )) && left=280
  stamp "$tag: $src $*, at most $left s"
  # shellcheck disable=SC2068  # the settings are words
  (cd "$src" && PYTHONPATH="$src" timeout $left python3 -m megatrain_ray.bench --preset 7b --steps 6 $@ \
     --tag "$tag" --out "$out") > "$out/log_$tag.txt" 2>&1; echo "rc=$?" >> "$out/log_$tag.txt"
  grep -E "^megatrain_ray|activations|^note|rc=|Error" "$out/log_$tag.txt" | cut -c1-300 | tail -5
done
stamp done
python3 benchmarks/bench_table.py "$out" old new
python3 - "$out" <<'EOF'
import json, os, sys
rows = {}
for tag in ("old", "new"):
    path = os.path.join(sys.argv[1], f"bench-{tag}.json")
    if os.path.exists(path):
        with open(path) as f:
            rows[tag] = json.load(f)["systems"]["megatrain_ray"]
if len(rows) == 2:
    o, n = rows["old"], rows["new"]
    print(f"new vs old: s/step {100 * (n['step_s'] / o['step_s'] - 1):+.2f}%, GPU peak "
          f"{n.get('device_peak_gib', 0) - o.get('device_peak_gib', 0):+.2f} GiB")
EOF
