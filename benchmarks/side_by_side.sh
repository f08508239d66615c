#!/usr/bin/env bash
# How do these settings compare at the 7B shape? Several bench runs in one call, then their table:
# each argument is TAG:SETTINGS, passed to `megatrain-ray bench --preset 7b --steps 6` as they are
# (empty: the defaults). Each run gets at most 280 s of the BUDGET seconds (default 570) left.
#   bash benchmarks/side_by_side.sh OUT "host:--set memory.resident=none" "embed-head:--set memory.resident=embed_head"
#   SMOKE=1 bash benchmarks/side_by_side.sh OUT "a:" "b:--set memory.buffer_depth=3"
source "$(dirname "$0")/lib.sh"
shift
if smoke; then common=("${SMOKE_ARGS[@]}"); else common=(--preset 7b --steps 6); fi
rc=0; tags=()
for spec in "$@"; do
  tag=${spec%%:*}; extra=${spec#*:}; tags+=("$tag")
  # shellcheck disable=SC2086  # the settings are words
  run "$tag" "$(left 280)" python3 -m megatrain_ray.cli bench "${common[@]}" $extra --tag "$tag" --out "$out" || rc=$?
done
python3 benchmarks/bench_table.py "$out" "${tags[@]}"
stamp done; exit $rc
