#!/bin/bash
# Device calls prepared in session 20 (.gpu/shared carried):
#   part a: what session 20's chain probe left open, the bytes in flight per program: tools/gpu/bench_chain.py
#           (its "tiles ..." ways: longer k-tiles, more rows; and its GPU test), bench_q8 --variants --latest
#           (q8_mv1 with fewer split-K programs, 1024-element k-tiles, 16 rows), then the whole model at 4k
#           with each (ab_decode) and the head's TMA tile (matvec.Q8_HEAD) once more.
#   part b: the routed gate/up with each sub-block's group sums added before its scaling (moe.MoeConfig.gsum,
#           off; sm_90 k loop 239 -> 218 instructions): its GPU tests, bench_moe --latest (B = 1 / 4 per
#           layer), the whole model at 4k with it (ab_decode), the B = 1 / 8 / 32 steps and the check.
# Usage: bash tools/gpu/session21.sh a|b
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=3 run tests 60 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_chain_probe.py
  TAIL=40 run chain 100 python3 tools/gpu/bench_chain.py --per-sm 4
  TAIL=14 run chain8k 60 python3 tools/gpu/bench_chain.py --n 8192 --stages 16 --per-sm 4  # 67 MB a stage
  TAIL=14 run bench 90 python3 tools/gpu/bench_q8.py --variants --latest
  TAIL=10 run ab "$(left)" python3 tools/gpu/ab_decode.py --rounds 2 \
    --variants "q8 target 1056,q8 target 528,q8 no split,q8 tk1024,q8 bn16,q8 head tma"
fi
if [ "$1" = b ]; then
  TAIL=4 run tests 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe.py \
    -k "variants"
  TAIL=12 run bench 120 python3 tools/gpu/bench_moe.py --latest
  TAIL=6 run ab 120 python3 tools/gpu/ab_decode.py --rounds 2 --variants "moe gsum,moe gsum pf"
  TAIL=8 run step "$(left)" env DS4_MOE_GSUM=1 python3 tools/gpu/batch_check.py --batches 1,8,32 --steps 16
fi
