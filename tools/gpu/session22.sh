#!/bin/bash
# Device calls prepared in session 21 (.gpu/shared carried):
#   part a: the figures at session 21's defaults (split-K target 528, the wide select by 8-bit digits): the
#           ds4-bench sweep 2k / 64k, then decode deep in the context (128k / 256k / 1M) with the sort past
#           20,480 rows (the default) and with the 8-bit wide select there too (DS4_INDEXER_WIDE_MAX=262144),
#           at up to 16 and 64 programs a row (the merge of 256-bin histograms is cheap now, so more
#           programs may pay on long rows): whether layer.INDEXER_WIDE_MAX can rise now.
#   part b: where the 64k and 4k steps go now (graph_timeline.py), 1,024-score wide chunks over 3 rounds
#           (session 21: x1.008 over 2), and 32 streams at 8k (ds4-bench --parallel 32, issue 8).
#   part c: where the batched step's time goes under graph replay (graph_timeline.py --batch 32 / 8 at 8k
#           ctx; session 14's profile was eager, PDL off), for issue 8.
# Usage: bash tools/gpu/session22.sh a|b|c
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=6 run sweep 150 python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 65536 \
    --step-mul 32 -n 64
  AT="--synthetic flash-q2 --decode-at 131072,262144,1048576 -n 32"
  TAIL=4 run long_default 110 python3 -m ds4.bench $AT
  TAIL=4 run long_wide8 110 env DS4_INDEXER_WIDE_MAX=262144 python3 -m ds4.bench $AT
  TAIL=4 run long_wide8_p64 "$(left)" env DS4_INDEXER_WIDE_MAX=262144 DS4_WIDE_PROGRAMS=64 \
    python3 -m ds4.bench $AT
fi
if [ "$1" = b ]; then
  TAIL=30 run timeline64k 100 python3 tools/gpu/graph_timeline.py --ctx 65536 --steps 8 --top 24
  TAIL=30 run timeline4k 80 python3 tools/gpu/graph_timeline.py --ctx 4096 --steps 8 --top 24
  TAIL=8 run ab64 120 python3 tools/gpu/ab_decode.py --ctx 65536 --rounds 3 --variants "wide c1024,wide d11"
  TAIL=4 run bench32 "$(left)" python3 -m ds4.bench --synthetic flash-q2 --parallel 32 --ctx-start 8192 \
    --ctx-max 8192 -n 32 --ttft-prompt 1024 --prefill-budget 512
fi
if [ "$1" = c ]; then
  TAIL=30 run timeline_b32 200 python3 tools/gpu/graph_timeline.py --ctx 8192 --batch 32 --steps 6 --top 24
  TAIL=30 run timeline_b8 "$(left)" python3 tools/gpu/graph_timeline.py --ctx 8192 --batch 8 --steps 6 \
    --top 24
fi
