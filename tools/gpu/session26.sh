#!/bin/bash
# Session 26: the grouped gate/up and down on the int8 tensor cores (GroupedConfig.mma / mma_dn: one
# mma.sync m16n8k32 a sub-block / k step of 16 rows x 4 pairs x 2 activation planes).
#   part a (H100 or H200, first 30 layers): the grouped GPU tests (mma at Flash widths against the pair
#           kernels), the per-layer bench with the mma variants, whole B = 16 / 32 steps with each and both.
#   part b (H200, the whole q2 model): the bars at the defaults (ds4-bench sweep 2k / 64k), B = 1 / 16 / 32
#           steps at 8k with the mma gate/up as the variant.
#   part c (little device time left): the Flash-width GPU test and the per-layer bench (the 16-byte-load
#           mma variants: does the L1 sector use bound the mma kernels?).
# Usage: bash tools/gpu/session26.sh a|b|c
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=4 run tests 110 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py \
    -k "mma or flash or match or other_ranks"
  TAIL=30 run bench1 110 python3 tools/gpu/bench_moe_grouped.py --latest "$OUT/b1"
  TAIL=12 run steps "$(left)" python3 tools/gpu/batch_check.py --skip-check --layers 30 \
    --variants "${VARIANTS:-grouped mma,grouped mma dn,grouped mma both}" --batches 16,32 --ctx 8192 --steps 16
fi
if [ "$1" = b ]; then
  TAIL=6 run sweep 200 python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 65536 \
    --step-mul 32 -n 64
  TAIL=10 run steps "$(left)" python3 tools/gpu/batch_check.py --variants "grouped mma both" \
    --batches 1,16,32 --ctx 8192 --steps 16
fi
if [ "$1" = c ]; then
  TAIL=3 run tests 90 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py \
    -k "flash"
  TAIL=16 run bench1 "$(left)" python3 tools/gpu/bench_moe_grouped.py --latest "$OUT/b1"
fi
