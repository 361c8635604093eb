#!/bin/bash
# Device calls prepared in session 18 for what it built without device time (.gpu/shared carried):
#   part a: the one-warp router / kv row kernels (fused.ROUTER_WARPS / KV_ROW_WARPS) and the attention merge
#           reading several key splits a step (attend.MERGE_CH): the attention / fused GPU tests, the
#           L2-prefetch tests left unrun in session 18, ab_decode at 4k with each variant, the B = 1 / 8 / 32
#           step with the merge variant.
# Usage: bash tools/gpu/session19.sh a
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=4 run tests 200 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_attend.py \
    tests/test_kernels_prefetch.py tests/test_kernels_fused.py tests/test_cuda_backend.py \
    -k "merge or attend_decode or prefetch or router or kv_norm"
  TAIL=12 run ab 180 python3 tools/gpu/ab_decode.py --rounds 2 \
    --variants "router w1,kv w1,kv w2,merge ch4,merge ch8,merge w2"
  TAIL=12 run step "$(left)" python3 tools/gpu/batch_check.py --skip-check --batches 1,8,32 --steps 16 \
    --variants "default,merge ch8,small warps"
fi
