#!/bin/bash
# Session 30: session 29's builds in one call, whichever card comes (device time was scarce: one call).
#   part a: the batched-vs-alone check at B = 1 / 3 / 8 / 16 with the small-row down tile
#           (GroupedConfig.bn_pair_dn_small 64) and q8_rows's f32t block scales both on; then whole steps at
#           B = 32 / 16, the default against "rows f32t" (all 43 layers on an H200, the first 30 on an H100).
#   part c (H200): B = 1 / 32 steps at the defaults and the ds4-bench sweep 2k / 64k (the bars).
# Usage: bash tools/gpu/session30.sh a|c   (BUDGET: seconds for the call, 570 by default)
source "$(dirname "$0")/session_lib.sh"
LAYERS=30
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && LAYERS=43
if [ "$1" = a ]; then
  TAIL=14 run check 220 env DS4_MOE_GROUPED_BN_PAIR_DN_SMALL=64 DS4_Q8_ROWS_SCALES=f32t \
    python3 tools/gpu/batch_check.py --skip-time --check-batches 1,3,8,16
  TAIL=8 run steps "$(left)" python3 tools/gpu/batch_check.py --skip-check --layers "$LAYERS" \
    --variants "rows f32t" --batches 32,16 --ctx 8192 --steps 16 --rounds 2
fi
if [ "$1" = c ]; then
  TAIL=10 run steps 150 python3 tools/gpu/batch_check.py --skip-check --batches 1,32 --ctx 8192 --steps 16
  TAIL=6 run sweep "$(left)" python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 65536 \
    --step-mul 32 -n 64
fi
