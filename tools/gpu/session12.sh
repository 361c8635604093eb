#!/bin/bash
# Device calls of session 12, one part per call (.gpu/shared carried, see session5.sh):
#   part a: the integer Q8_0 decode matvec (matvec.Q8Config.int8: x in two int8 planes per 32 values,
#           dp4a): its kernel tests on the GPU, bench_q8.py --variants (every q8_mv1 variant per Flash
#           shape), the official / 4-layer / replay backend tests with it on, whole-model A/B at 4k ctx.
# Usage: bash tools/gpu/session12.sh a
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=6 run tests 200 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_quant.py \
    tests/test_kernels_moe.py -k "q8_mv1 or int_twin or block32 or quantize"
  TAIL=16 run variants 150 python3 tools/gpu/bench_q8.py --variants
  TAIL=6 run backend 200 env DS4_Q8_INT8=1 python3 -m pytest -q -p no:cacheprovider -p no:warnings \
    tests/test_cuda_backend.py -k "official or flash_width or repeatable"
  TAIL=8 run ab "$(left)" python3 tools/gpu/ab_decode.py --rounds 2 --variants "q8 int8,q8 int8 bn16"
fi
