#!/bin/bash
# Session 29: the parts session 28 left for next (tools/gpu/session28.sh f / g / h), fitted to one call each.
#   part a: the GPU tests of the small-row down tile and of the quad layout; the batched-vs-alone check at
#           B = 1 / 3 / 8 / 16 with the down's 64-row tile below 16 rows (GroupedConfig.bn_pair_dn_small:
#           off until this passes); the quad layout per layer (bench_moe_grouped --pick=-2,-1).
#   part b: 20-layer B = 16 / 32 steps with the quad layout (grouped qp), then q8_rows at BN 128 on 30-layer
#           B = 24 / 32 steps.
#   part d: q8_rows reading f32 copies of the block scales (Q8RowsConfig.scales: the f16 scales' 2-byte loads
#           are staged by hand, STS.U16 the top stall at B = 32; f32: cp.async, sm_90 STS 1 -> 0 in the k loop,
#           127 -> 166 registers): GPU tests, bench_q8 --rows, 30-layer B = 16 / 32 steps.
#   part e: a and d in one call: GPU tests of both, the check at B = 1 / 3 / 8 / 16 with the small-row down
#           tile AND the f32t scales on (f32t is bit-equal to f16 under the interpreter), steps 'rows f32t'.
#   part f: e for a short call: the check (both on), then 'rows f32t' steps at B = 32 in what is left.
#   part c (H200, the whole q2 model): B = 1 / 32 steps and the bars at the defaults (ds4-bench 2k / 64k).
# Usage: bash tools/gpu/session29.sh a|b|c   (BUDGET: seconds for the call, 570 by default)
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=3 run tests 110 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py \
    -k "flash or small_rows or routed or quad"
  TAIL=14 run check 230 env DS4_MOE_GROUPED_BN_PAIR_DN_SMALL=64 python3 tools/gpu/batch_check.py \
    --skip-time --check-batches 1,3,8,16
  TAIL=16 run bench "$(left)" python3 tools/gpu/bench_moe_grouped.py --pick=-2,-1 "$OUT/qp"
fi
if [ "$1" = b ]; then
  TAIL=8 run qp 260 python3 tools/gpu/batch_check.py --skip-check --layers 20 --variants "grouped qp" \
    --batches 16,32 --ctx 8192 --steps 16 --rounds 2
  TAIL=8 run rows "$(left)" python3 tools/gpu/batch_check.py --skip-check --layers 30 \
    --variants "rows:bn=128,rows:bn=128+stages=4" --batches 24,32 --ctx 8192 --steps 16 --rounds 2
fi
if [ "$1" = d ]; then
  TAIL=3 run tests 90 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_quant.py \
    -k "q8_rows"
  TAIL=12 run rows 150 python3 tools/gpu/bench_q8.py --rows --cfgs "f32,f32t,bn128,bn128 f32t,f32t r144"
  TAIL=8 run steps "$(left)" python3 tools/gpu/batch_check.py --skip-check --layers 30 \
    --variants "rows f32,rows f32t" --batches 16,32 --ctx 8192 --steps 16 --rounds 2
fi
if [ "$1" = e ]; then
  TAIL=3 run tests 100 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_quant.py \
    tests/test_kernels_moe_grouped.py -k "scale_cop or q8_rows_f32 or small_rows or flash"
  TAIL=14 run check 230 env DS4_MOE_GROUPED_BN_PAIR_DN_SMALL=64 DS4_Q8_ROWS_SCALES=f32t \
    python3 tools/gpu/batch_check.py --skip-time --check-batches 1,3,8,16
  TAIL=8 run steps "$(left)" python3 tools/gpu/batch_check.py --skip-check --layers 30 \
    --variants "rows f32t" --batches 16,32 --ctx 8192 --steps 16 --rounds 2
fi
if [ "$1" = f ]; then
  TAIL=14 run check 230 env DS4_MOE_GROUPED_BN_PAIR_DN_SMALL=64 DS4_Q8_ROWS_SCALES=f32t \
    python3 tools/gpu/batch_check.py --skip-time --check-batches 1,3,8,16
  TAIL=8 run steps "$(left)" python3 tools/gpu/batch_check.py --skip-check --layers 30 \
    --variants "rows f32t" --batches 32 --ctx 8192 --steps 16 --rounds 2
fi
if [ "$1" = c ]; then
  TAIL=10 run steps 150 python3 tools/gpu/batch_check.py --skip-check --batches 1,32 --ctx 8192 --steps 16
  TAIL=6 run sweep "$(left)" python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 65536 \
    --step-mul 32 -n 64
fi
