#!/bin/bash
# Session 31: what waits on a card, in one call, whichever card comes.
#   part a: on an H200 first the bars (B = 1 / 32 steps at the defaults, the ds4-bench sweep 2k / 64k);
#           then on any card the GPU tests of q8_rows's f32t scales (on by default since session 30, never
#           run compiled) and of the quad layout, the per-layer gate/up bench with the quad layout (session
#           28's part h, never timed); on an H100 20-layer B = 16 / 32 steps "grouped qp" (30 ran out of memory).
# Usage: bash tools/gpu/session31.sh a|b   (BUDGET: seconds for the call, 570 by default)
source "$(dirname "$0")/session_lib.sh"
H200=0
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && H200=1
if [ "$1" = a ]; then
  if [ "$H200" = 1 ]; then
    TAIL=10 run steps 130 python3 tools/gpu/batch_check.py --skip-check --batches 1,32 --ctx 8192 --steps 16
    TAIL=6 run sweep 200 python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 65536 \
      --step-mul 32 -n 64
  fi
  TAIL=3 run tests 90 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_quant.py \
    tests/test_kernels_moe_grouped.py -k "scale_cop or rows_f32 or quad or flash"
  TAIL=24 run bench 100 python3 tools/gpu/bench_moe_grouped.py --pick=-2,-1 "$OUT/qp"
  [ "$H200" = 0 ] && TAIL=8 run steps "$(left)" python3 tools/gpu/batch_check.py --skip-check --layers 20 \
    --variants "grouped qp" --batches 16,32 --ctx 8192 --steps 16 --rounds 2
fi
#   part b: the quad layout in the engine (moe_grouped.QUAD_STACKS, packing.to_quad): 20-layer steps (30 on
#           an H200) "quad" (every kernel on the quad-only stacks: the B = 1 step on moe._iq2_q8k_qp) and
#           "grouped qp r128 from 1" at B = 1 / 32 and an 8k prefill (B = 0: QT 116's dequantization; the
#           prefill bar is only just met); the GPU tests of the quad readers; the batched-vs-alone
#           check with DS4_MOE_QUAD=1; per layer at B = 1 / 2 / 4 against the pair kernel.
if [ "$1" = b ]; then
  L=20
  [ "$H200" = 1 ] && L=30
  TAIL=10 run steps 240 python3 tools/gpu/batch_check.py --skip-check --layers "$L" \
    --variants "quad,grouped qp r128 from 1" --batches 1,32 --ctx 8192 --steps 16 --rounds 2 --prefill 8192
  TAIL=4 run tests 90 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe.py \
    tests/test_kernels_quant.py tests/test_kernels_moe_grouped.py -k "quad"
  TAIL=12 run check 110 env DS4_MOE_QUAD=1 python3 tools/gpu/batch_check.py --skip-time \
    --check-batches 1,3,16
  TAIL=30 run small "$(left)" python3 tools/gpu/bench_moe_grouped.py --pick=-2,-1 --batches=1,2,4 "$OUT/small"
fi
