#!/bin/bash
# Device calls of the sixth session (the first GPU time since session 4), one part per call:
#   part a: the whole model vs the CPU reference with session 5's defaults (launch cuts, q8_rows for batched
#           rows), the changed kernels' GPU tests, bench_q8 --variants / --rows, then the whole-model A/B of
#           the switches (tools/gpu/ab_decode.py);
#   part b: the graph-pool regression test, the switches' A/B (after the pool fix), batched decode (the 2e-2
#           check at B = 8, 16; B = 1 / 32 timed), the fused-kernel bench, where a decode step's kernel time
#           goes (profile_regions);
#   part c: the side-stream branches and the one-pass HC finish (now defaults): GPU tests, A/B, then the same
#           under programmatic dependent launch (DS4_PDL=1; import-time, so two processes), B = 1 / 32 timed;
#   part d: with the final defaults (PDL on): the ds4-bench sweep 2k -> 8k, batched decode (B = 16 checked,
#           B = 32 timed).
# Needs .gpu/shared carried (see session5.sh). Usage: bash tools/gpu/session6.sh a|b|c|d
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=8 run model 220 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_cuda_backend.py \
    tests/test_cuda_batch.py
  TAIL=8 run ktests 90 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_quant.py \
    tests/test_kernels_fused.py -k "q8 or magic or fixup or flash or hc_pre"
  TAIL=14 run q8var 50 python3 tools/gpu/bench_q8.py --variants
  TAIL=36 run q8rows 60 python3 tools/gpu/bench_q8.py --rows
  TAIL=16 run ab "$(left)" python3 tools/gpu/ab_decode.py --rounds 2
elif [ "$1" = b ]; then
  TAIL=4 run graph 60 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_cuda_backend.py \
    tests/test_cuda_batch.py -k "recaptured or official_tiny_batch"
  TAIL=16 run ab 150 python3 tools/gpu/ab_decode.py --rounds 2
  TAIL=22 run batch 200 python3 tools/gpu/batch_check.py --batches 1,32 --check-batches 8,16 \
    --check-steps 4 --repeats 2 --plain
  TAIL=10 run fused 40 python3 tools/gpu/bench_kernels.py --fused-only
  TAIL=75 run profile "$(left)" python3 tools/gpu/profile_regions.py 8192
elif [ "$1" = c ]; then
  TAIL=4 run tests 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_cuda_backend.py \
    tests/test_kernels_side.py tests/test_kernels_fused.py -k "side_stream or recaptured or official or lane or hc_pre"
  TAIL=16 run ab 130 python3 tools/gpu/ab_decode.py --rounds 2
  TAIL=4 run pdltests 80 env DS4_PDL=1 python3 -m pytest -q -p no:cacheprovider -p no:warnings \
    tests/test_cuda_backend.py -k "cuda_matches_official or side_stream"
  TAIL=10 run ab_pdl 130 env DS4_PDL=1 python3 tools/gpu/ab_decode.py --rounds 2
  TAIL=8 run batch "$(left)" python3 tools/gpu/batch_check.py --skip-check --batches 1,32 --repeats 2 --plain
else
  export BUDGET=320
  TAIL=8 run sweep 170 python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 8192 \
    --step-mul 4 -n 64 --repeats 2 --prompt-file .gpu/shared/bench-text/promessi_sposi.txt --csv "$OUT/sweep.csv"
  TAIL=12 run batch "$(left)" python3 tools/gpu/batch_check.py --batches 32 --check-batches 16 \
    --check-steps 4 --repeats 2 --plain
fi
