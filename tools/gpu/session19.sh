#!/bin/bash
# Device calls prepared in session 18 for what it built without device time (.gpu/shared carried):
#   part a: the one-warp router / kv row kernels (fused.ROUTER_WARPS / KV_ROW_WARPS) and the attention merge
#           reading several key splits a step (attend.MERGE_CH): the attention / fused GPU tests, the
#           L2-prefetch tests left unrun in session 18, ab_decode at 4k with each variant, the B = 1 / 8 / 32
#           step with the merge variant.
#   part b: the L2 prefetch spread over more programs and on side lane 4 (layer.PREFETCH sites attn / o /
#           ffn): bench_prefetch.py (does a prefetched matvec read L2, how long the prefetch kernel takes),
#           the prefetch GPU tests, ab_decode with each site.
#   part c: the integer Q8_0 paths together: q8_rows mode int8 at the default 2 warps (mma.sync; session
#           13 timed it at 4 warps on wgmma) and the batch-1 int8 matvec, whose x planes then equal the
#           batched rows' (the batched-vs-alone check failed with only the batch-1 one on): bench_q8 --rows,
#           ab_decode "q8 int8 bn4", B = 1 / 8 / 32 steps, the check with both on.
# Usage: bash tools/gpu/session19.sh a|b|c
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
if [ "$1" = b ]; then
  TAIL=6 run bench 90 python3 tools/gpu/bench_prefetch.py
  TAIL=4 run tests 200 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_prefetch.py \
    tests/test_cuda_backend.py -k "prefetch"
  TAIL=14 run ab "$(left)" python3 tools/gpu/ab_decode.py --rounds 2 \
    --variants "prefetch o,prefetch o main,prefetch o 4k,prefetch attn,prefetch ffn,prefetch all"
fi
if [ "$1" = c ]; then
  TAIL=12 run rows 150 python3 tools/gpu/bench_q8.py --rows --cfgs "int8,int8 bn32,int8 s4"
  TAIL=6 run ab 150 python3 tools/gpu/ab_decode.py --rounds 2 --variants "q8 int8 bn4"
  TAIL=12 run step 200 python3 tools/gpu/batch_check.py --skip-check --batches 1,8,32 --steps 16 \
    --variants "default,rows int8,rows int8 + mv1 int8"
  TAIL=10 run check "$(left)" env DS4_Q8_ROWS_MODE=int8 DS4_Q8_INT8=1 python3 tools/gpu/batch_check.py \
    --skip-time --check-batches 1,3,8,16
fi
# Inline calls on the warm machine after part c (as run):
#   python3 tools/gpu/long_decode.py 65536 262144 524288 1048576
#   for e in "X=0" "DS4_INDEXER_SELECT_MAX=1048576" "DS4_INDEXER_SELECT=0 DS4_INDEXER_TOPK=1"; do
#     env $e python3 tools/gpu/long_decode.py 262144 1048576; done
#   DS4_PDL=0 python3 tools/gpu/long_decode.py --profile 1048576
#   for c in 4096 65536; do DS4_PDL=0 python3 tools/gpu/long_decode.py --profile $c; done   (a fresh machine)
#   for e in "X=0" "DS4_ATTEND_MERGE_CH=4" "DS4_ATTEND_MERGE_CH=8" "X=1"; do
#     env $e python3 tools/gpu/long_decode.py 65536 1048576; done
