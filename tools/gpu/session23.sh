#!/bin/bash
# Device calls prepared in sessions 21 and 22 (.gpu/shared carried). Session 22 got no device time (its one
# call was lost with the machine), so session 21's plan (parts b, c) still stands, after part a:
#   part a (session 23 made both builds defaults from H100 runs; the variants are now the old settings):
#           the decode step's tail as Triton launches (model.cuda.fused.TAIL_FUSED; built in session 22
#           without a GPU): its GPU tests (the kernels at Flash shapes, the official model against the torch
#           tail), the whole model at 4k with it (ab_decode "tail torch" as the variant, 3 rounds), then the
#           ds4-bench sweep 2k / 64k at the defaults of session 21 (split-K target 528, the 8-bit wide select), and
#           the B = 1 / 16 / 32 steps with the tail fused and with the merged q_a + kv / gate + up matrices
#           read by one q8_rows launch up to 64 rows (layer.MERGED_ROWS; batch_check --variants, which
#           now recaptures the B = 1 graph per variant too).
#   part b: decode deep in the context (128k / 256k / 1M) with the sort past 20,480 rows (the default) and
#           with the 8-bit wide select there too (DS4_INDEXER_WIDE_MAX=262144), at 16 and 64 programs a row:
#           whether layer.INDEXER_WIDE_MAX can rise now.
#   part c: where the 64k / 4k steps go now (graph_timeline.py) and the batched step under graph replay
#           (--batch 32 at 8k, issue 8), then 32 streams at 8k through ds4-bench --parallel (TTFT).
# Usage: bash tools/gpu/session23.sh a|b|c
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=3 run tests 120 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_fused.py \
    tests/test_cuda_backend.py -k "tail or hash or head or flash_shapes or official"
  TAIL=8 run ab 150 python3 tools/gpu/ab_decode.py --rounds 3 --variants "tail torch"
  TAIL=6 run sweep 150 python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 65536 \
    --step-mul 32 -n 64
  TAIL=12 run steps "$(left)" python3 tools/gpu/batch_check.py --variants "tail torch,merged rows 8" \
    --batches 1,16,32 --ctx 8192 --steps 16
fi
if [ "$1" = b ]; then
  AT="--synthetic flash-q2 --decode-at 131072,262144,1048576 -n 32"
  TAIL=4 run long_default 120 python3 -m ds4.bench $AT
  TAIL=4 run long_wide8 120 env DS4_INDEXER_WIDE_MAX=262144 python3 -m ds4.bench $AT
  TAIL=4 run long_wide8_p64 "$(left)" env DS4_INDEXER_WIDE_MAX=262144 DS4_WIDE_PROGRAMS=64 \
    python3 -m ds4.bench $AT
fi
if [ "$1" = c ]; then
  TAIL=30 run timeline64k 100 python3 tools/gpu/graph_timeline.py --ctx 65536 --steps 8 --top 24
  TAIL=30 run timeline4k 80 python3 tools/gpu/graph_timeline.py --ctx 4096 --steps 8 --top 24
  TAIL=30 run timeline_b32 180 python3 tools/gpu/graph_timeline.py --ctx 8192 --batch 32 --steps 6 --top 24
  TAIL=4 run bench32 "$(left)" python3 -m ds4.bench --synthetic flash-q2 --parallel 32 --ctx-start 8192 \
    --ctx-max 8192 -n 32 --ttft-prompt 1024 --prefill-budget 512
fi
