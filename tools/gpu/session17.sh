#!/bin/bash
# Device calls of session 17, one part per call (.gpu/shared carried, see session5.sh):
#   part a: the HC combine Sinkhorn as its own launch on side lane 2 (model.cuda.fused.HC_COMB_SIDE) and
#           the finish kernel's partial sums in one chunk of 128 splits (fused.HC_FINISH_BNS; was 32):
#           GPU tests, ab_decode at 4k ctx against each old side, the B = 2 / 8 / 32 step likewise (and
#           q8_rows from 2 rows at B = 2).
# Usage: bash tools/gpu/session17.sh a|b|c|d
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=4 run tests 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_fused.py \
    tests/test_kernels_hc.py -k "hc"
  TAIL=4 run model 120 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_cuda_backend.py \
    -k "hc_comb or side_stream or official"
  TAIL=8 run ab 160 python3 tools/gpu/ab_decode.py --rounds 2 --variants "hc comb main,hc bns32"
  TAIL=14 run step "$(left)" python3 tools/gpu/batch_check.py --skip-check --batches 2,8,32 --steps 16 \
    --variants "default,hc comb main,hc bns32,q8 rows from 2"
fi
# part b: the batched-vs-alone check at the new defaults; ds4-bench at 32 streams, 8k (the issue-8
#         figure) and at 8 streams.
if [ "$1" = b ]; then
  TAIL=18 run check 240 python3 tools/gpu/batch_check.py --skip-time --check-batches 1,2,3,8,16
  TAIL=12 run bench32 170 python3 -m ds4.bench --synthetic flash-q2 --parallel 32 --ctx-start 8192 \
    --ctx-max 8192 -n 32 --ttft-prompt 1024 --prefill-budget 512
  TAIL=8 run bench8 "$(left)" python3 -m ds4.bench --synthetic flash-q2 --parallel 8 --ctx-start 8192 \
    --ctx-max 8192 -n 32
fi
# part c: the decode indexer's top-k by radix select (ds4.kernels.topk.select_rows, layer.INDEXER_SELECT):
#         GPU tests, bench_topk_hc (per call against the sort), ab_decode at 4k and 64k ctx against the
#         sort, the official-fixture model tests.
if [ "$1" = c ]; then
  TAIL=4 run tests 100 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_topk.py
  TAIL=12 run bench 60 python3 tools/gpu/bench_topk_hc.py
  TAIL=4 run model 160 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_cuda_backend.py \
    -k "official or flash_width"
  TAIL=8 run ab4k 120 python3 tools/gpu/ab_decode.py --rounds 2 --variants "indexer sort"
  TAIL=8 run ab64k "$(left)" python3 tools/gpu/ab_decode.py --ctx 65536 --rounds 2 --variants "indexer sort"
fi
# part d (as run, inline commands on the machine): the select for rows of <= topk.SELECT_CHUNK scores only
#         (64k ctx keeps the sort: part c); the batched-vs-alone check, ab_decode at 64k; the ds4-bench
#         sweep at 2k / 64k and at 32 streams, 8k.
if [ "$1" = d ]; then
  TAIL=14 run check 170 python3 tools/gpu/batch_check.py --skip-time --check-batches 1,3,8
  TAIL=8 run ab64k 110 python3 tools/gpu/ab_decode.py --ctx 65536 --rounds 1 --tokens 48 --variants "indexer sort"
  TAIL=6 run sweep 150 python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 65536 --step-mul 32 -n 64
  TAIL=4 run bench32 "$(left)" python3 -m ds4.bench --synthetic flash-q2 --parallel 32 --ctx-start 8192 \
    --ctx-max 8192 -n 32 --ttft-prompt 1024 --prefill-budget 512
fi
