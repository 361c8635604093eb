#!/bin/bash
# Device calls of session 16, one part per call (.gpu/shared carried, see session5.sh):
#   part a: the IQ2_XXS nibble tables in static shared memory (moe._lds_fill / _lds: PTX-declared, read
#           by ld.shared; MoeConfig.lds, GroupedConfig.lds): GPU tests of the pair and grouped kernels,
#           bench_moe --latest (B = 1 / 4), bench_moe_grouped --latest, the B = 16 / 32 step, ab_decode.
# Usage: bash tools/gpu/session16.sh a|b|c|d|e|f
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=4 run tests 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py \
    tests/test_kernels_moe.py -k "prmt or decode_variants or grouped"
  TAIL=24 run pair 100 sh -c "python3 tools/gpu/bench_moe.py --latest | grep -E 'B = |us|VERDICT'"
  TAIL=30 run grouped 120 sh -c "python3 tools/gpu/bench_moe_grouped.py --latest | grep -E 'B = |lds|masks prmt|per layer|check'"
  TAIL=12 run step 150 python3 tools/gpu/batch_check.py --skip-check --batches 16,32 --steps 16 \
    --variants "default,grouped lds,grouped lds math"
  TAIL=8 run ab "$(left)" python3 tools/gpu/ab_decode.py --rounds 2 --variants "moe lds,moe lds math"
fi
# part b: the pair down kernel taking the pairs in expert order (GroupedConfig.sorted_down: a repeated
#         expert's weights read from L2): grouped tests; the batched-vs-alone check with the narrow q8_rows
#         tile (Q8_ROWS_NARROW, B <= 16: session 15's x1.017 step, left off until this check ran); the
#         B = 16 / 32 step with each.
if [ "$1" = b ]; then
  TAIL=4 run tests 90 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py
  TAIL=14 run check 230 env DS4_Q8_ROWS_NARROW=1 python3 tools/gpu/batch_check.py --skip-time \
    --check-batches 1,3,8,16
  TAIL=8 run step "$(left)" python3 tools/gpu/batch_check.py --skip-check --batches 16,32 --steps 16 \
    --variants "default,grouped sorted down,rows narrow"
fi
# part c: both on by default (narrow rows, sorted down): q8_rows tests; the B = 32 / 64 step against the
#         unsorted down; ds4-bench at 32 streams, 8k (the issue-8 figure).
if [ "$1" = c ]; then
  TAIL=4 run tests 80 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_quant.py -k q8_rows
  TAIL=12 run step 150 python3 tools/gpu/batch_check.py --skip-check --batches 32,64 --steps 16 \
    --variants "default,grouped unsorted down"
  TAIL=12 run bench32 "$(left)" python3 -m ds4.bench --synthetic flash-q2 --parallel 32 --ctx-start 8192 \
    --ctx-max 8192 -n 32 --ttft-prompt 1024 --prefill-budget 512
fi
# part d: tiles of the batched MoE at B = 32 / 64: the pair down kernel's tile (as run: bn 128 / 32 / 256,
#         bn 128 / 256 at 8 warps against bn 64; bn 128 is GroupedConfig.bn_pair_dn now, "pair down bn64"
#         the old side), the grouped gate/up at 2 pairs a program and at bn 32 / 8 warps.
if [ "$1" = d ]; then
  TAIL=14 run step "$(left)" python3 tools/gpu/batch_check.py --skip-check --batches 16,32,64 --steps 16 \
    --variants "default,pair down bn64,grouped pt2,grouped bn32 w8"
fi
# part e: the batched-vs-alone check and the grouped tests with the pair down tile at 128 rows.
if [ "$1" = e ]; then
  TAIL=4 run tests 90 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py
  TAIL=14 run check "$(left)" python3 tools/gpu/batch_check.py --skip-time --check-batches 1,3,8,16
fi
# part f (as run, inline commands on the warm machine): the pair down tile at 128 rows; ds4-bench at 32
#         streams again; the int8 grouped experts from 8 rows; a B = 8 profile (profile_batch.py 8: the
#         CUDA-core Q8_0 tiles, _qmv_kernel, took 12.3 of 34.5 ms); q8_rows from 3 / 5 rows instead of 9
#         (matvec.Q8_ROWS_FROM, now 3; as run, "q8 rows from 3" against the default 9) and the
#         batched-vs-alone check with it.
if [ "$1" = f ]; then
  TAIL=16 run step 280 python3 tools/gpu/batch_check.py --skip-check --batches 16,32,64 --steps 16 \
    --variants "default,pair down bn64"
  TAIL=6 run bench32 190 python3 -m ds4.bench --synthetic flash-q2 --parallel 32 --ctx-start 8192 \
    --ctx-max 8192 -n 32 --ttft-prompt 1024 --prefill-budget 512
  TAIL=8 run step8 190 python3 tools/gpu/batch_check.py --skip-check --batches 8,12 --steps 16 \
    --variants "default,grouped from 8"
  TAIL=45 run profile8 180 env DS4_PDL=0 DS4_Q8_ROWS_FROM=9 python3 tools/gpu/profile_batch.py 8 8192
  TAIL=10 run rows_from 115 python3 tools/gpu/batch_check.py --skip-check --batches 4,8 --steps 16 \
    --variants "default,q8 rows from 5,q8 rows from 9,side rows from 2"
  TAIL=14 run check "$(left)" python3 tools/gpu/batch_check.py --skip-time --check-batches 1,3,8,16
fi
