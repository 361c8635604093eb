#!/bin/bash
# Device calls prepared in session 7 (after its GPU time was spent), one part per call:
#   part a: the shipped defaults measured as shipped (split-bf16 attention, Q8_0 prefetch, context buckets,
#           early PDL trigger off): GPU tests (replays repeatable, official cases, attention kernels), the
#           ds4-bench sweep 2k -> 8k (3 passes), the attention tiles and the fused split merge
#           (attend.FUSED_MERGE: bench_attend.py, then ab_decode.py), decode at 64k;
#   part b: the early trigger's question: the replay test and the B = 8 check twice with DS4_PDL_EARLY=1
#           (equal figures and a passing test: deterministic, then flip it on by the A/B of session 7), and
#           batched decode under the defaults (B = 8, 16 checked; B = 32 timed).
#   part c: q8_rows's block-product modes (matvec.Q8_ROWS_MODES: tf32x2, bf16x2, bf16x3; their GPU tests,
#           then bench_q8.py --rows per mode); set DS4_Q8_ROWS_MODE's default by its per-step VERDICT, then
#           re-run batch_check B = 16 checked / 32 timed with it.
#   part d: the routed-expert decode variants (moe.MoeConfig.prmt / grid16, GroupedConfig.prmt / grid16 /
#           sign_math: bit-identical by the CPU tests): their GPU tests, bench_moe.py --quick,
#           bench_moe_grouped.py, the whole-model A/B at B = 1, B = 32 timed with DS4_MOE_GROUPED_PRMT=1.
#   part e (after a-d): the flipped defaults (early trigger on, q8_rows bf16x2, grouped experts with computed
#           sign masks and down at bn 64 / 2 pairs): their tests and official cases, batched decode checked
#           and timed, the sweep; then the variants whose tables failed inside a graph capture in part d.
# Needs .gpu/shared carried (see session5.sh). Usage: bash tools/gpu/session8.sh a|b|c|d|e
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=3 run tests 200 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_attend.py \
    tests/test_cuda_backend.py -k "attend or repeatable or official or ctx_bucket or side_stream or recaptured"
  TAIL=6 run sweep 200 python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 8192 \
    --step-mul 4 -n 64 --repeats 3 --prompt-file .gpu/shared/bench-text/promessi_sposi.txt --csv "$OUT/sweep.csv"
  TAIL=24 run bench_attend 90 python3 tools/gpu/bench_attend.py
  TAIL=6 run ab 150 python3 tools/gpu/ab_decode.py --rounds 2 --variants "attend fused"
  TAIL=4 run decode "$(left)" python3 tools/gpu/quick_decode.py q2
elif [ "$1" = d ]; then
  TAIL=3 run tests 120 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe.py \
    tests/test_kernels_moe_grouped.py -k "grid16 or variants or prmt"
  TAIL=30 run bench_moe 120 python3 tools/gpu/bench_moe.py --quick
  TAIL=20 run bench_grouped 100 python3 tools/gpu/bench_moe_grouped.py
  TAIL=6 run ab 130 python3 tools/gpu/ab_decode.py --rounds 2 --variants "moe no prmt,moe grid16"
  DS4_MOE_GROUPED_PRMT=1 TAIL=4 run batch32 "$(left)" python3 tools/gpu/batch_check.py --batches 32 \
    --skip-check --repeats 2 --plain
elif [ "$1" = e ]; then
  TAIL=3 run tests 200 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py \
    tests/test_kernels_moe.py tests/test_kernels_quant.py tests/test_cuda_backend.py \
    -k "grouped or grid16 or variants or prmt or q8_rows or official or repeatable"
  TAIL=10 run batch 100 python3 tools/gpu/batch_check.py --batches 32 --check-batches 8,16 \
    --check-steps 4 --repeats 2 --plain
  TAIL=6 run sweep 110 python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 8192 \
    --step-mul 4 -n 64 --repeats 3 --prompt-file .gpu/shared/bench-text/promessi_sposi.txt --csv "$OUT/sweep.csv"
  TAIL=24 run bench_grouped 60 python3 tools/gpu/bench_moe_grouped.py
  TAIL=6 run ab 90 python3 tools/gpu/ab_decode.py --rounds 2 --variants "moe no prmt,moe grid16"
  DS4_MOE_GROUPED_PRMT=1 TAIL=4 run batch32_prmt "$(left)" python3 tools/gpu/batch_check.py --batches 32 \
    --skip-check --repeats 2 --plain
elif [ "$1" = c ]; then
  TAIL=3 run tests 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_quant.py \
    -k q8_rows
  for m in tf32x2 bf16x2 bf16x3; do
    DS4_Q8_ROWS_MODE=$m TAIL=8 run "rows_$m" 120 python3 tools/gpu/bench_q8.py --rows
  done
else
  DS4_PDL_EARLY=1 TAIL=3 run replay 120 python3 -m pytest -q -p no:cacheprovider -p no:warnings \
    tests/test_cuda_backend.py -k repeatable
  for i in 1 2; do
    DS4_PDL_EARLY=1 TAIL=3 run "check8_early_$i" 75 python3 tools/gpu/batch_check.py --check-batches 8 \
      --check-steps 4 --skip-time
  done
  TAIL=10 run batch "$(left)" python3 tools/gpu/batch_check.py --batches 32 --check-batches 8,16 \
    --check-steps 4 --repeats 2 --plain
fi
