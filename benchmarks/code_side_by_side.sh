#!/usr/bin/env bash
# The 7B benchmark of several versions of the code on one machine in one device call: the code of one
# or more older commits (each a folder holding its tree) and the current tree, one after the other,
# with the same settings; then their s/step and GPU peak side by side, and the current code's
# difference from each older one in percent.
#
#   bash benchmarks/code_side_by_side.sh OUT OLD_TREE[,OLD_TREE...] [SETTINGS...]
#
# OLD_TREE: a folder with an older commit's files (its megatrain_ray package is enough), made before
# the device call so it travels with the working tree (an untracked folder that git does not ignore),
# e.g. for main at 9a476a2 and 695dfc0:
#   for c in 9a476a2 695dfc0; do git archive $c megatrain_ray --prefix=old_$c/ | tar -x; done
#   bash benchmarks/code_side_by_side.sh $OUT old_9a476a2,old_695dfc0
# or, where the device machine has the repository's history, a commit (it is extracted to OUT/old-N).
# The runs are tagged old-1, old-2, ... in the order given, then new (OUT/versions.txt says which is
# which). SETTINGS are passed to `megatrain_ray.bench --preset 7b --steps 6` as they are (none: the
# defaults). Each run gets an equal share of what is left of the BUDGET seconds (default 580 for two
# runs, 270 more for each further older tree), at most 280 s.
set -uo pipefail
out=${1:?usage: code_side_by_side.sh OUT OLD_TREE_OR_COMMIT[,...] [SETTINGS...]}; olds=${2:?old tree(s) or commit(s)}; shift 2
mkdir -p "$out"; : > "$out/versions.txt"
here=$(pwd)
IFS=, read -r -a given <<< "$olds"
trees=(); tags=()
for i in "${!given[@]}"; do
  old=${given[$i]}; tag="old-$((i + 1))"
  if [ ! -d "$old" ]; then
    git archive "$old" --prefix="$tag/" | tar -x -C "$out" || { echo "cannot extract commit $old"; exit 2; }
    old="$out/$tag"
  fi
  trees+=("$(cd "$old" && pwd)"); tags+=("$tag")
  echo "$tag: ${given[$i]}" >> "$out/versions.txt"
done
trees+=("$here"); tags+=(new)
echo "new: $(git rev-parse --short HEAD 2>/dev/null || echo "$here")" >> "$out/versions.txt"
budget=${BUDGET:-$(( 580 + 270 * (${#given[@]} - 1) ))}
export PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
for i in "${!tags[@]}"; do
  tag=${tags[$i]}; src=${trees[$i]}
  left=$(( (budget - ($(date +%s) - t0)) / (${#tags[@]} - i) )); (( left > 280 )) && left=280
  stamp "$tag: $src $*, at most $left s"
  # shellcheck disable=SC2068  # the settings are words
  (cd "$src" && PYTHONPATH="$src" timeout $left python3 -m megatrain_ray.bench --preset 7b --steps 6 $@ \
     --tag "$tag" --out "$out") > "$out/log_$tag.txt" 2>&1; echo "rc=$?" >> "$out/log_$tag.txt"
  grep -E "^megatrain_ray|activations|^note|rc=|Error" "$out/log_$tag.txt" | cut -c1-300 | tail -5
done
stamp done
cat "$out/versions.txt"
python3 benchmarks/bench_table.py "$out" "${tags[@]}"
python3 - "$out" "${tags[@]}" <<'EOF'
import json, os, sys
rows = {}
for tag in sys.argv[2:]:
    path = os.path.join(sys.argv[1], f"bench-{tag}.json")
    if os.path.exists(path):
        with open(path) as f:
            rows[tag] = json.load(f)["systems"]["megatrain_ray"]
new = rows.get("new")
for tag, old in rows.items():
    if new is not None and tag != "new":
        print(f"new vs {tag}: s/step {100 * (new['step_s'] / old['step_s'] - 1):+.2f}%, GPU peak "
              f"{new.get('device_peak_gib', 0) - old.get('device_peak_gib', 0):+.2f} GiB, compute "
              f"{100 * new.get('compute_busy_frac', 0):.1f}% vs {100 * old.get('compute_busy_frac', 0):.1f}% of the step")
EOF
