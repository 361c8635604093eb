#!/bin/bash
# Device calls prepared in session 19 for what it built without device time (.gpu/shared carried):
#   part a: the indexer top-k with several programs a row (topk.select_rows_wide, layer.INDEXER_WIDE, off):
#           its GPU tests (and the top-k / model ones), bench_topk_hc (per call, equal sets at 4k .. 1M ctx),
#           the whole model at 64k ctx with it (ab_decode) and at 64k / 256k / 1M (ds4-bench --decode-at,
#           one process per setting).
#   part b: the Q8_0 batch-1 matvec with its weight tiles by TMA copies into a ring of shared buffers
#           (matvec.Q8Config.tma, DS4_Q8_TMA, off): its GPU tests at the Flash shapes, bench_q8 --variants
#           --latest (per shape and per decode step), the whole model at 4k ctx with each tile.
#   part c: the B = 1 routed-expert kernels with their super-block loops software-pipelined by Triton
#           (moe.MoeConfig.stages, off): their GPU tests, bench_moe --latest (B = 1 / 4 per layer), the whole
#           model at 4k ctx with each, and the batched steps with the pair down's (moe.DOWN's) at 3 stages.
#   part d: after a-c: the wide select on by default up to layer.INDEXER_WIDE_MAX (16,384 scores: 64k ctx),
#           the output head by the TMA kernel at 32 rows (matvec.Q8_HEAD, off): their GPU tests; the head
#           in the whole model at 4k ctx (ab_decode); decode at 128k / 256k / 1M with the wide select there
#           too, at 16 and 32 programs a row (ds4-bench --decode-at, one process each); the ds4-bench sweep
#           2k / 64k at the defaults (with the head's TMA tile if ab_decode found it faster).
#   part f: tools/gpu/bench_chain.py (a kernel boundary's cost vs a grid barrier's in a chain of dependent
#           Q8_0 matvecs) with its GPU test; the head's TMA tile at 4k over 3 rounds.
# Usage: bash tools/gpu/session20.sh a|b|c|d|e|f
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=4 run tests 200 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_topk.py \
    tests/test_cuda_backend.py -k "select or topk or official"
  TAIL=8 run bench 90 python3 tools/gpu/bench_topk_hc.py
  TAIL=4 run long_off 80 python3 -m ds4.bench --synthetic flash-q2 --decode-at 65536,262144,1048576 -n 32
  TAIL=4 run long_on 80 env DS4_INDEXER_WIDE=1 python3 -m ds4.bench --synthetic flash-q2 \
    --decode-at 65536,262144,1048576 -n 32
  TAIL=8 run ab "$(left)" python3 tools/gpu/ab_decode.py --ctx 65536 --rounds 2 --variants "select wide"
fi
if [ "$1" = b ]; then
  TAIL=4 run tests 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_quant.py \
    tests/test_cuda_backend.py -k "q8_mv1 or official"
  TAIL=14 run bench 120 python3 tools/gpu/bench_q8.py --variants --latest
  TAIL=10 run ab "$(left)" python3 tools/gpu/ab_decode.py --rounds 2 \
    --variants "q8 tma,q8 tma bn32,q8 tma bn8,q8 tma s3,q8 tma s6,q8 pipe"
fi
if [ "$1" = c ]; then
  TAIL=4 run tests 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe.py \
    -k "variants"
  TAIL=16 run bench 150 python3 tools/gpu/bench_moe.py --latest
  TAIL=10 run ab 150 python3 tools/gpu/ab_decode.py --rounds 2 \
    --variants "moe st3,moe gu st3,moe dn st3,moe st2"
  TAIL=8 run step "$(left)" python3 tools/gpu/batch_check.py --skip-check --batches 1,8,32 --steps 16 \
    --variants "default,dn st3"
fi
#   part e: part d's default (INDEXER_WIDE_MAX 16,384) missed the 64k allocation (cap 16,420 rows): at
#           20,480, the whole model at 64k against the sort there (ab_decode "no wide") and the sweep again.
if [ "$1" = e ]; then
  TAIL=8 run ab64 100 python3 tools/gpu/ab_decode.py --ctx 65536 --rounds 2 --variants "no wide"
  TAIL=6 run sweep "$(left)" python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 65536 \
    --step-mul 32 -n 64
fi
if [ "$1" = d ]; then
  TAIL=4 run tests 110 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_quant.py \
    tests/test_cuda_backend.py -k "q8_head or (q8_mv1_flash and tma) or wide or official"
  TAIL=5 run ab 100 python3 tools/gpu/ab_decode.py --rounds 2 --variants "q8 head tma"
  AT="--synthetic flash-q2 --decode-at 131072,262144,1048576 -n 32"
  TAIL=4 run long_default 80 python3 -m ds4.bench $AT
  TAIL=4 run long_wide16 80 env DS4_INDEXER_WIDE_MAX=262144 python3 -m ds4.bench $AT
  TAIL=4 run long_wide32 80 env DS4_INDEXER_WIDE_MAX=262144 DS4_WIDE_PROGRAMS=32 python3 -m ds4.bench $AT
  HEAD=0
  grep -q "VERDICT q8 head tma: faster" "$OUT/ab.log" && HEAD=1
  TAIL=6 run sweep "$(left)" env DS4_Q8_HEAD_TMA=$HEAD python3 -m ds4.bench --synthetic flash-q2 \
    --ctx-start 2048 --ctx-max 65536 --step-mul 32 -n 64
  echo "sweep with DS4_Q8_HEAD_TMA=$HEAD"
fi
if [ "$1" = f ]; then
  TAIL=3 run tests 60 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_chain_probe.py
  TAIL=64 run chain 90 python3 tools/gpu/bench_chain.py
  TAIL=7 run ab "$(left)" python3 tools/gpu/ab_decode.py --rounds 3 --variants "q8 head tma"
fi
