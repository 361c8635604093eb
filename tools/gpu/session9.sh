#!/bin/bash
# Device calls prepared in session 8 (after its GPU time was spent), one part per call:
#   part a: the grouped gate/up instruction cuts (moe_grouped.GroupedConfig.chain / pos_reg, sm_90 k loop
#           454 -> 389 instructions but 64 -> 96 registers) and prmt with computed sign nibbles
#           (sign_math under prmt): their tests, bench_moe_grouped.py, a B = 32 step under each switch, the
#           B = 1 whole-model A/B of the pair kernel's variant; flip by the step times.
#   part b: the shipped defaults measured as shipped (sweep 2k -> 8k, decode at 64k), where an 8k prefill's
#           time goes (profile_regions.py: the prefill bar is the furthest after batched decode), and
#           the B = 16 batched check with q8_rows bf16x2 against the default, now printing where the worst
#           difference sits (one outlier row: a rounding point flipping; all rows: a real error);
#           bench_moe --quick if time is left.
# Needs .gpu/shared carried (see session5.sh). Usage: bash tools/gpu/session9.sh a|b
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=3 run tests 200 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py \
    tests/test_kernels_moe.py tests/test_cuda_backend.py -k "grouped or prmt or variants or capture or official"
  TAIL=40 run bench_grouped 60 python3 tools/gpu/bench_moe_grouped.py
  for v in "" DS4_MOE_GROUPED_CHAIN=1 DS4_MOE_GROUPED_POS_REG=1 "DS4_MOE_GROUPED_CHAIN=1 DS4_MOE_GROUPED_POS_REG=1" \
      DS4_MOE_GROUPED_SIGN_MATH=1; do
    echo "--- B = 32 step with: ${v:-the defaults}"
    env $v timeout 60 python3 tools/gpu/batch_check.py --batches 32 --skip-check --repeats 2 --plain 2>&1 \
      | grep -E "^ *32 "
  done
  TAIL=6 run ab "$(left)" python3 tools/gpu/ab_decode.py --rounds 2 --variants "moe prmt math"
else
  TAIL=6 run sweep 110 python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 8192 \
    --step-mul 4 -n 64 --repeats 3 --prompt-file .gpu/shared/bench-text/promessi_sposi.txt --csv "$OUT/sweep.csv"
  TAIL=4 run decode 120 python3 tools/gpu/quick_decode.py q2
  TAIL=60 run profile 150 python3 tools/gpu/profile_regions.py 8192
  for m in tf32x2 bf16x2; do
    DS4_Q8_ROWS_MODE=$m TAIL=5 run "check16_$m" 70 python3 tools/gpu/batch_check.py --check-batches 16 \
      --check-steps 4 --skip-time
  done
  TAIL=12 run bench_moe "$(left)" python3 tools/gpu/bench_moe.py --quick
fi
