#!/bin/bash
# Session 25: the grouped gate/up's tables in 16 shared copies (moe_grouped.CONFIG lds_rep 16, on from the
# H100's 30-layer steps: B = 16 / 32 x1.021 / x1.013), and the bars at the defaults on the whole model.
#   part a (H200, the whole q2 model): the grouped and official-model GPU tests, the ds4-bench sweep 2k / 64k
#           (issue 5's bars), then B = 1 / 16 / 32 steps at 8k with the L1 gathers as the variant (issue 8's).
#   part b (H100 or H200, first 30 layers): the same steps with the old tables as the variant, 3 rounds.
#   part c (H200, little device time left): part a without the tests and the check.
#   part d (prepared after the device time was spent; H100 or H200): the grouped gate/up capped at 64
#           registers (16 copies: 8 programs an SM instead of 6; 32 copies: 5; 16 copies of the grid nibbles
#           with the sign nibbles computed), its tests, the bench, steps.
# Usage: bash tools/gpu/session25.sh a|b|c|d
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=3 run tests 120 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py \
    tests/test_cuda_backend.py -k "variants or prefetch or flash or match or official"
  TAIL=6 run sweep 200 python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 65536 \
    --step-mul 32 -n 64
  TAIL=10 run steps "$(left)" python3 tools/gpu/batch_check.py --variants "grouped tables l1" \
    --batches 1,16,32 --ctx 8192 --steps 16
fi
if [ "$1" = b ]; then
  TAIL=3 run tests 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py \
    tests/test_cuda_batch.py -k "variants or prefetch or flash or match or batch or official"
  TAIL=14 run steps "$(left)" python3 tools/gpu/batch_check.py --layers 30 --variants "grouped tables l1" \
    --batches 16,32 --ctx 8192 --steps 16 --rounds 3 --check-batches 1,3,16
fi
if [ "$1" = c ]; then
  TAIL=6 run sweep 170 python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 65536 \
    --step-mul 32 -n 64
  TAIL=6 run steps "$(left)" python3 tools/gpu/batch_check.py --skip-check --variants "grouped tables l1" \
    --batches 1,32 --ctx 8192 --steps 16
fi
if [ "$1" = d ]; then
  TAIL=3 run tests 90 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py \
    -k "variants_change_no_bit"
  TAIL=24 run bench1 100 python3 tools/gpu/bench_moe_grouped.py --latest "$OUT/b1"
  TAIL=10 run steps "$(left)" python3 tools/gpu/batch_check.py --skip-check --layers 30 \
    --variants "grouped r64,grouped lds x32 r64,grouped math r64" --batches 16,32 --ctx 8192 --steps 16
fi
