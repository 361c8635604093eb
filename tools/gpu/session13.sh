#!/bin/bash
# Device calls of session 13, one part per call (.gpu/shared carried, see session5.sh):
#   part a: where a B = 32 step goes now (profile_batch.py without PDL, 8k ctx), and session 12's best
#           integer Q8_0 variant (4 rows x 1024) on the whole model at 4k ctx.
#   part b: q8_rows's int8 mode (x in two int8 planes, int8 MMAs) and the expert-runs counting kernel: their
#           GPU tests, the B = 16 / 32 step per switch (batch_check.py --variants), bench_q8.py --rows, the
#           batched-vs-alone check with both integer Q8_0 paths on.
#   part c: q8_rows's k loop with more bytes per stage (Q8RowsConfig.blocks / stages): bench_q8.py --rows,
#           the B = 16 / 32 step per variant, and the batched-vs-alone check with the integer batch-1 matvec
#           alone on (DS4_Q8_INT8=1: the candidate default).
#   part d: the scalar HC finish with one reciprocal per normalisation (fused._div4): its tests, whole-model
#           A/B at 4k ctx; backend tests and the batched-vs-alone check at the defaults (expert_runs kernel).
#   part e: q8_rows's split-K depth (Q8RowsConfig.min_blocks: each split writes an f32 partial) and BN in
#           bench_q8.py --rows, the B = 32 step with its best config and with the side matrices' split-K
#           summed in the kernel (HMV_LARGE.fixup), then the TTFT of a new request while
#           31 others stream (ds4-bench --parallel 32).
# Usage: bash tools/gpu/session13.sh a|b|c|d|e
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=34 run profile32 200 env DS4_PDL=0 python3 tools/gpu/profile_batch.py 32 8192
  TAIL=8 run ab "$(left)" python3 tools/gpu/ab_decode.py --rounds 2 --variants "q8 int8 bn4"
fi
if [ "$1" = b ]; then
  TAIL=6 run tests 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_quant.py \
    tests/test_kernels_moe_grouped.py -k "q8_rows or expert_runs or grouped_kernels"
  TAIL=12 run variants 200 python3 tools/gpu/batch_check.py --skip-check --batches 16,32 --steps 16 \
    --variants "rows int8,runs sort,rows int8 + mv1 int8"
  TAIL=8 run check 130 env DS4_Q8_ROWS_MODE=int8 DS4_Q8_INT8=1 python3 tools/gpu/batch_check.py --skip-time \
    --check-batches 1,3,8,16
  TAIL=10 run rows "$(left)" python3 tools/gpu/bench_q8.py --rows
fi
if [ "$1" = c ]; then
  TAIL=4 run tests 100 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_quant.py \
    -k "q8_rows"
  TAIL=24 run rows 170 python3 tools/gpu/bench_q8.py --rows
  TAIL=12 run variants 190 python3 tools/gpu/batch_check.py --skip-check --batches 16,32 --steps 16 \
    --variants "rows nb4,rows nb4 s2,rows s5,mv1 int8"
  TAIL=12 run check "$(left)" env DS4_Q8_INT8=1 python3 tools/gpu/batch_check.py --skip-time \
    --check-batches 1,3,8,16
fi
if [ "$1" = d ]; then
  TAIL=4 run tests 90 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_fused.py \
    -k "hc_pre"
  TAIL=8 run ab 150 python3 tools/gpu/ab_decode.py --rounds 2 --variants "hc scalar"
  TAIL=14 run check 100 python3 tools/gpu/batch_check.py --skip-time --check-batches 1,3,8,16
  TAIL=6 run backend "$(left)" python3 -m pytest -q -p no:cacheprovider -p no:warnings \
    tests/test_cuda_backend.py tests/test_cuda_batch.py -k "official or flash_width or repeatable or batch"
fi
if [ "$1" = e ]; then
  TAIL=30 run rows 80 python3 tools/gpu/bench_q8.py --rows
  best=$(sed -n 's/^BEST32 //p' "$OUT/rows.log")
  echo "best q8_rows config at B = 32: ${best:-none}"
  variants="hmv fixup"
  if [ -n "$best" ] && [ "$best" != none ]; then variants="rows:${best//,/+},hmv fixup"; fi
  TAIL=8 run variants 130 python3 tools/gpu/batch_check.py --skip-check --batches 16,32 --steps 16 \
    --variants "$variants"
  TAIL=12 run ttft "$(left)" python3 -m ds4.bench --synthetic flash-q2 --parallel 32 --ctx-start 8192 \
    --ctx-max 8192 -n 32 --ttft-prompt 1024 --prefill-budget 512
fi
