#!/usr/bin/env bash
# Session 7, first device call (nvidia-h200): the 7B benchmark with the defaults a user gets (the
# split AdamW update on: moments + stream copy first, master weights while the next step runs)
# against the same with runtime.split_update=false, side by side in one call (issue 16).
#   bash benchmarks/h200_s7a.sh $OUT
set -uo pipefail
exec bash "$(dirname "$0")/bench_side_by_side.sh" "${1:-/tmp/out}" "7b-split:" "7b-onepass:--set runtime.split_update=false"
