#!/bin/bash
# Device calls of session 15, one part per call (.gpu/shared carried, see session5.sh):
#   part a: q8_rows at 1 / 2 warps (mma.sync instead of wgmma: the x split and both operands in registers,
#           matvec.Q8_ROWS): GPU tests, bench_q8 --rows against the default and the B = 64 tile, the
#           B = 16 / 32 step with the two likeliest configs. (As run, the default was 4 warps and the list
#           began with "w2"; 2 warps is the default now, so its other side is "w4".)
#   part b: the batched-vs-alone check with q8_rows at 2 warps; a fresh B = 32 profile.
#   part c: the grouped gate/up with its tables looked up by tl.gather (shared memory, GroupedConfig.smem):
#           grouped tests, bench_moe_grouped, the B = 16 / 32 step against q8_rows w2 and both together.
#   part d: q8_rows at 2 warps as the default (tests), the B = 1 expert tiles with more programs
#           (bench_moe --latest, ab_decode), the B = 64 step with the wide rows tile.
#   part e: the flat Q8_0 matvec (Q8Config.flat): tests, bench_q8 --variants --latest, ab_decode; the B = 16
#           step with the narrow rows tile; a B = 1 profile (profile_regions.py 8192).
# Usage: bash tools/gpu/session15.sh a|b|c|d|e
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=4 run tests 100 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_quant.py -k q8_rows
  TAIL=16 run rows 230 sh -c "python3 tools/gpu/bench_q8.py --rows --cfgs \
'w4,w2 t2112,bn32 w2,bn32 w1,bn32 w2 t2112,bn128 w8 mb16' | grep -E 'per decode|VERDICT|BEST|max rel|B=32|32 '"
  TAIL=12 run step "$(left)" python3 tools/gpu/batch_check.py --skip-check --batches 16,32 --steps 16 \
    --variants "default,rows:warps=2,rows:bn=32+warps=2"
fi
if [ "$1" = b ]; then
  TAIL=14 run check 200 env DS4_Q8_ROWS_WARPS="${WARPS:-2}" DS4_Q8_ROWS_BN="${BN:-64}" \
    python3 tools/gpu/batch_check.py --skip-time --check-batches 1,3,8,16
  TAIL=40 run profile32 "$(left)" env DS4_PDL=0 python3 tools/gpu/profile_batch.py 32 8192
fi
if [ "$1" = c ]; then
  # the grouped gate/up's tables looked up by tl.gather (shared memory; GroupedConfig.smem 1 / 2)
  TAIL=4 run tests 120 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py
  TAIL=30 run grouped 150 sh -c "python3 tools/gpu/bench_moe_grouped.py --latest | grep -E 'B = |smem|masks prmt|per layer|check'"
  TAIL=12 run step "$(left)" python3 tools/gpu/batch_check.py --skip-check --batches 16,32 --steps 16 \
    --variants "default,grouped smem1,grouped smem2,rows w2,rows w2 + smem2"
fi
if [ "$1" = d ]; then
  # q8_rows at 2 warps now the default; the B = 1 expert tiles (more programs); the B = 64 rows tile
  TAIL=4 run tests 90 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_quant.py -k q8_rows
  TAIL=24 run pair 110 sh -c "python3 tools/gpu/bench_moe.py --latest | grep -E 'B = |us|VERDICT'"
  TAIL=8 run ab 190 python3 tools/gpu/ab_decode.py --rounds 2 --variants "moe bn8,moe s2,moe down bn32"
  TAIL=8 run step64 "$(left)" python3 tools/gpu/batch_check.py --skip-check --batches 64 --steps 8 \
    --variants "default,rows wide,rows w4"
fi
if [ "$1" = e ]; then
  # the flat Q8_0 matvec (Q8Config.flat: long-lived programs, the next k-tile loaded before this one's math)
  TAIL=4 run tests 90 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_quant.py -k "q8_mv1 or flat"
  TAIL=14 run q8 90 python3 tools/gpu/bench_q8.py --variants --latest
  TAIL=8 run ab 150 python3 tools/gpu/ab_decode.py --rounds 2 --variants "q8 flat,q8 flat 1056"
  TAIL=6 run step16 130 python3 tools/gpu/batch_check.py --skip-check --batches 16 --steps 16 \
    --variants "default,rows narrow"
  TAIL=30 run profile1 "$(left)" python3 tools/gpu/profile_regions.py 8192
fi
