#!/bin/bash
# Session 24: the grouped gate/up's k loop with fewer instructions (sm_90, at 1 / 2 / 4 pairs: the engine's
# 229 / 304 / 454): one dp4a chain per sub-block + the permutes' positive word loaded (201 / 269 / 376),
# the IQ2_XXS nibble tables in static shared memory with it (the sign table's offset the load's immediate:
# 195 / 276 / 400), all three (183 / 246 / 362), and all three at 32 rows a program (319 / 423 / 616 for
# twice the weights; 4 or 2 pairs). Each bit-identical to the engine's (the GPU test below).
# Runs on an H100 or an H200 (4 layers of experts; batch steps on the first 30 layers).
#   part a: the grouped kernels' GPU tests, bench_moe_grouped.py --latest (per layer, B = 8 / 16 / 32),
#           then whole B = 16 / 32 steps at 8k with two of them (batch_check.py --variants).
#   part b: part a without the whole steps (the tests of the variants, the bench): for little device time.
#   part c: the bench alone.
# Usage: bash tools/gpu/session24.sh a|b|c
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=3 run tests 120 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py \
    -k "variants or flash or match"
  TAIL=30 run bench1 90 python3 tools/gpu/bench_moe_grouped.py --latest "$OUT/b1"
  TAIL=12 run steps "$(left)" python3 tools/gpu/batch_check.py --skip-check --layers 30 \
    --variants "grouped lds chain preg,grouped lcp bn32" --batches 16,32 --ctx 8192 --steps 16
fi
if [ "$1" = b ]; then
  TAIL=3 run tests 100 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py \
    -k "variants"
  TAIL=40 run bench1 "$(left)" python3 tools/gpu/bench_moe_grouped.py --latest "$OUT/b1"
fi
if [ "$1" = c ]; then
  TAIL=40 run bench1 "$(left)" python3 tools/gpu/bench_moe_grouped.py --latest "$OUT/b1"
fi
