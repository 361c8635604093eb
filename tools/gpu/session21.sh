#!/bin/bash
# Device calls prepared in session 20 (.gpu/shared carried):
#   part a: what session 20's chain probe left open, the bytes in flight per program: tools/gpu/bench_chain.py
#           (its "tiles ..." ways: longer k-tiles, more rows; and its GPU test), bench_q8 --variants --latest
#           (q8_mv1 with fewer split-K programs, 1024-element k-tiles, 16 rows), then the whole model at 4k
#           with each (ab_decode) and the head's TMA tile (matvec.Q8_HEAD) once more.
#   part b: the routed gate/up with each sub-block's group sums added before its scaling (moe.MoeConfig.gsum,
#           off; sm_90 k loop 239 -> 218 instructions): its GPU tests, bench_moe --latest (B = 1 / 4 per
#           layer), the whole model at 4k with it (ab_decode), the B = 1 / 8 / 32 steps and the check.
#   part c: where the replayed decode graph's time goes (tools/gpu/graph_timeline.py at 4k ctx: span, idle,
#           the main stream's exclusive times and gaps by kernel), the Q8_0 tile variants of parts a / b's
#           leads over 4 rounds, the batched-vs-alone check at the paths the engine takes (B = 1, 3, 8, 16).
#           (Run with "q8 target 528" and "q8 528 tk1024 body" where the list now names "q8 target 2112" and
#           nothing: target 528 became the default, which "q8 tk1024 body" now runs at.)
#   part d: at the new default (split-K target 528): the Q8_0 GPU tests, graph_timeline (the chain of kernel
#           ends), other targets (ab_decode 3 rounds), the ds4-bench sweep 2k / 64k.
#   part e: (run inline on the warm machine) graph_timeline at 64k ctx; the wide select's chunk sizes at 64k
#           ctx (ab_decode "wide c1024,c512,c256") with the top-k GPU tests.
#   part f: the wide select by 8-bit digits (topk.WIDE_DIGITS, off): top-k GPU tests (both digit sets) and
#           the whole-model bit check, then the whole model at 64k ctx with it (and at 1,024-score chunks).
#           (Run with 11-bit the default and the variants "wide d8,wide d8 c1024"; 8-bit is the default now,
#           so the list below names the same comparison from the other side.)
# Usage: bash tools/gpu/session21.sh a|b|c|d|e|f
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=3 run tests 60 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_chain_probe.py
  TAIL=40 run chain 100 python3 tools/gpu/bench_chain.py --per-sm 4
  TAIL=14 run chain8k 60 python3 tools/gpu/bench_chain.py --n 8192 --stages 16 --per-sm 4  # 67 MB a stage
  TAIL=14 run bench 90 python3 tools/gpu/bench_q8.py --variants --latest
  TAIL=10 run ab "$(left)" python3 tools/gpu/ab_decode.py --rounds 2 \
    --variants "q8 target 1056,q8 target 528,q8 no split,q8 tk1024,q8 bn16,q8 head tma"
fi
if [ "$1" = b ]; then
  TAIL=4 run tests 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe.py \
    -k "variants"
  TAIL=12 run bench 120 python3 tools/gpu/bench_moe.py --latest
  TAIL=6 run ab 120 python3 tools/gpu/ab_decode.py --rounds 2 --variants "moe gsum,moe gsum pf"
  TAIL=8 run step "$(left)" env DS4_MOE_GSUM=1 python3 tools/gpu/batch_check.py --batches 1,8,32 --steps 16
fi
if [ "$1" = c ]; then
  TAIL=3 run tests 30 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_graph_timeline.py
  TAIL=45 run timeline 150 python3 tools/gpu/graph_timeline.py --ctx 4096 --steps 8 --top 40
  TAIL=12 run ab 200 python3 tools/gpu/ab_decode.py --rounds 4 \
    --variants "q8 target 2112,q8 tk1024,q8 tk1024 body"
  TAIL=24 run check "$(left)" python3 tools/gpu/batch_check.py --skip-time
fi
if [ "$1" = d ]; then
  TAIL=3 run tests 120 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_quant.py \
    tests/test_graph_timeline.py
  TAIL=45 run timeline 120 python3 tools/gpu/graph_timeline.py --ctx 4096 --steps 8 --top 40
  TAIL=8 run ab 130 python3 tools/gpu/ab_decode.py --rounds 3 \
    --variants "q8 target 2112,q8 target 264,q8 target 396,q8 target 792"
  TAIL=6 run sweep "$(left)" python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 65536 \
    --step-mul 32 -n 64
fi
if [ "$1" = e ]; then
  TAIL=30 run timeline64k 200 python3 tools/gpu/graph_timeline.py --ctx 65536 --steps 8 --top 24
  TAIL=3 run tests 60 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_topk.py
  TAIL=10 run ab64 240 python3 tools/gpu/ab_decode.py --ctx 65536 --rounds 2 \
    --variants "wide c1024,wide c512,wide c256"
fi
if [ "$1" = f ]; then
  TAIL=3 run tests 100 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_topk.py \
    tests/test_cuda_backend.py -k "select or top_rows or wide"
  TAIL=10 run ab64 "$(left)" python3 tools/gpu/ab_decode.py --ctx 65536 --rounds 2 \
    --variants "wide d11,wide c1024"
fi
