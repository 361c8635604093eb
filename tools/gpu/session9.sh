#!/bin/bash
# Device calls prepared in session 8 (after its GPU time was spent), one part per call:
#   part a: the routed-expert kernels changed without an H200 run: the pair kernels' barrier-free loops (the
#           defaults: gate/up sub-block words as bytes, down by _q2k_block_sums; session 8 measured
#           gate+up 37.7 us, down 25.3 us per B = 1 layer call) and the grouped gate/up instruction cuts
#           (GroupedConfig.chain / pos_reg, off) and prmt with computed sign nibbles (off): their tests,
#           bench_moe.py --quick, bench_moe_grouped.py, a B = 32 step under each grouped switch (session 8:
#           70.93 ms), and one with 16 keys per block in the ratio-128 layers' attention
#           (attend.ATTEND_BN_DENSE); flip by the step times.
#   part b: the shipped defaults as shipped (sweep 2k -> 8k: session 8 95.40 / 94.70 tok/s; decode at 64k:
#           85.3), where an 8k prefill's time goes (profile_regions.py), the B = 16 batched check with
#           q8_rows bf16x2, now printing where its worst difference sits (one outlier row: a rounding point
#           flipping; all rows: a real error), then the B = 1 A/B of prmt's computed sign nibbles.
# Needs .gpu/shared carried (see session5.sh). Usage: bash tools/gpu/session9.sh a|b|c
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=3 run tests 200 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py \
    tests/test_kernels_moe.py tests/test_cuda_backend.py -k "not bench"
  TAIL=30 run bench_moe 60 python3 tools/gpu/bench_moe.py --quick
  TAIL=40 run bench_grouped 60 python3 tools/gpu/bench_moe_grouped.py
  for v in "" DS4_MOE_GROUPED_CHAIN=1 "DS4_MOE_GROUPED_CHAIN=1 DS4_MOE_GROUPED_POS_REG=1" DS4_ATTEND_BN_DENSE=16; do
    echo "--- B = 32 step with: ${v:-the defaults}"
    env $v timeout 60 python3 tools/gpu/batch_check.py --batches 32 --skip-check --repeats 2 --plain 2>&1 \
      | grep -E "^ *32 "
  done
elif [ "$1" = b ]; then
  for v in "" DS4_ATTEND_BN_DENSE=16; do
    echo "--- B = 32 step with: ${v:-the defaults}"
    env $v timeout 150 python3 tools/gpu/batch_check.py --batches 32 --skip-check --repeats 2 --plain \
      > "$OUT/b32${v:+_dense16}.log" 2>&1; echo "rc $?"; grep -E "^ *32 |Error" "$OUT/b32${v:+_dense16}.log"
  done
  TAIL=6 run sweep 110 python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 8192 \
    --step-mul 4 -n 64 --repeats 3 --prompt-file .gpu/shared/bench-text/promessi_sposi.txt --csv "$OUT/sweep.csv"
  TAIL=8 run ab "$(left)" python3 tools/gpu/ab_decode.py --rounds 2 --variants "moe prmt math,moe down s2"
elif [ "$1" = d ]; then
  TAIL=4 run tests 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_gemm.py \
    tests/test_kernels_fused.py -k "linear or hc_pre"
  TAIL=8 run prefill_ab 240 python3 tools/gpu/prefill_ab.py 8192
  DS4_PREFILL_CHUNK=8192 TAIL=4 run sweep8k "$(left)" python3 -m ds4.bench --synthetic flash-q2 --ctx-start 8192 --ctx-max 8192 \
    -n 32 --repeats 2 --prompt-file .gpu/shared/bench-text/promessi_sposi.txt --csv "$OUT/sweep8k.csv"
else
  TAIL=60 run profile 150 python3 tools/gpu/profile_regions.py 8192
  TAIL=5 run check16 90 python3 tools/gpu/batch_check.py --check-batches 16 --check-steps 4 --skip-time
  DS4_Q8_ROWS_MODE=bf16x2 TAIL=5 run check16_bf16x2 70 python3 tools/gpu/batch_check.py --check-batches 16 \
    --check-steps 4 --skip-time
  TAIL=4 run decode 90 python3 tools/gpu/quick_decode.py q2
fi
