#!/bin/bash
# Device calls of session 11, one part per call (.gpu/shared carried, see session5.sh):
#   part a: the scalar S = 4 HC finish (fused.HC_FINISH_SCALAR) and the indexer top-k kernel
#           (ds4.kernels.topk, layer.TOPK_KERNEL): their tests on the GPU, the official / 4-layer / replay
#           backend tests, bench_topk_hc.py (each vs what it replaces), whole-model A/B at 4k and 64k ctx,
#           the decode step's kernel profile after them.
# Usage: bash tools/gpu/session11.sh a
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=6 run tests 200 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_topk.py \
    tests/test_kernels_fused.py -k "topk or top_rows or hc_pre"
  TAIL=6 run backend 200 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_cuda_backend.py \
    -k "official or flash_width or repeatable"
  TAIL=12 run bench 60 python3 tools/gpu/bench_topk_hc.py
  TAIL=8 run ab 120 python3 tools/gpu/ab_decode.py --rounds 2 --variants "hc tile finish,topk sort"
  TAIL=8 run ab64k 120 python3 tools/gpu/ab_decode.py --rounds 2 --ctx 65536 --variants "topk sort"
  TAIL=45 run profile "$(left)" python3 tools/gpu/profile_regions.py 8192
fi
