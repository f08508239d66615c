#!/usr/bin/env bash
# How does megatrain_ray compare with the offload modes users would run instead (DeepSpeed ZeRO-3 with
# parameter and optimizer offload, FSDP2 with CPUOffloadPolicy), on the same model, tokens and clipping?
#   bash benchmarks/peers.sh OUT [PRESET]          # default 7b; one H200: ~9 minutes; needs pip install deepspeed
#   SMOKE=1 bash benchmarks/peers.sh OUT           # the CPU, a tiny model, FSDP2 only
# Writes OUT/bench-peers-<preset>.json (one table: ours, each peer, ours x) and the peers' logs.
source "$(dirname "$0")/lib.sh"
preset=${2:-7b}
if smoke; then
  run peers-tiny 300 python3 benchmarks/peers.py --preset tiny --systems fsdp2 --layers 2 --tokens 256 --seq-len 32 \
    --micro-batches 2 --steps 2 --device cpu --out "$out"
  rc=$?; tail -4 "$out/log_peers-tiny.txt"
else
  run "peers-$preset" "$(left 560)" python3 benchmarks/compare.py --preset "$preset" --steps 4 --peers deepspeed,fsdp2 \
    --peer-timeout-s 200 --tag "peers-$preset" --out "$out"
  rc=$?; grep -A4 "^system" "$out/log_peers-$preset.txt"
fi
stamp done; exit $rc
