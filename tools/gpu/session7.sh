#!/bin/bash
# Device calls prepared in session 6 (after its GPU time was spent), one part per call:
#   part a: the context-bucket graphs (model.CTX_BUCKETS, off) and the side-stream / PDL defaults: GPU tests,
#           then tools/gpu/ctx_ab.py (buckets at a 256k allocation 2k deep; the indexer's torch.topk at 64k
#           deep) and decode at 2k / 64k (quick_decode.py);
#   part b: the ds4-bench sweep 2k -> 8k (3 passes: median leaves the cold one out) and batched decode
#           (B = 8, 16 checked; B = 32 timed), then one eager B = 32 step at 8k profiled (profile_batch.py).
#   part c: the early PDL trigger (dispatch.PDL_EARLY) and the weight prefetch before the wait
#           (Q8Config.prefetch, HalfConfig.prefetch): kernel + official-case tests with them on, then the
#           whole-model A/B (tools/gpu/ab_decode.py) in a process without and one with the early trigger.
#   part d: one eager B = 32 step at 8k profiled without PDL (with it a kernel's time includes its wait for
#           the one before), and the B = 8 batched check without the early trigger / without buckets.
#   part e: split-bf16 tensor-core attention (attend.ATTEND_PREC "bf16x3"): kernel tests, the official cases
#           with it, bench_attend.py, whole-model A/B at B = 1, B = 32 timed with it; then the B = 8 check
#           without the early trigger.
#   part f: the B = 8 check twice under the defaults (early trigger on): equal figures = deterministic.
# Then: flip model.CTX_BUCKETS / layer.INDEXER_TOPK by their VERDICT lines. Needs .gpu/shared carried (see
# session5.sh). Usage: bash tools/gpu/session7.sh a|b|c|d|e|f
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=4 run tests 200 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_cuda_backend.py \
    tests/test_cuda_batch.py tests/test_kernels_side.py -k "ctx or side_stream or recaptured or official or lane"
  TAIL=8 run ctx 200 python3 tools/gpu/ctx_ab.py --alloc 262144 --rounds 2
  TAIL=4 run decode "$(left)" python3 tools/gpu/quick_decode.py q2
elif [ "$1" = d ]; then
  DS4_PDL=0 TAIL=22 run profile 150 python3 tools/gpu/profile_batch.py 32 8192
  DS4_PDL_EARLY=0 TAIL=3 run check_no_early 150 python3 tools/gpu/batch_check.py --check-batches 8 \
    --check-steps 4 --skip-time
elif [ "$1" = e ]; then
  TAIL=3 run tests 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_attend.py
  DS4_ATTEND_PREC=bf16x3 TAIL=3 run official 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings \
    tests/test_cuda_backend.py -k official
  TAIL=22 run bench 120 python3 tools/gpu/bench_attend.py
  TAIL=6 run ab 150 python3 tools/gpu/ab_decode.py --rounds 2 --variants "attend bf16x3"
  DS4_ATTEND_PREC=bf16x3 TAIL=4 run batch32 120 python3 tools/gpu/batch_check.py --batches 32 --skip-check \
    --repeats 2 --plain
  DS4_PDL_EARLY=0 TAIL=3 run check_no_early "$(left)" python3 tools/gpu/batch_check.py --check-batches 8 \
    --check-steps 4 --skip-time
elif [ "$1" = f ]; then
  for i in 1 2; do
    TAIL=3 run "check8_$i" 75 python3 tools/gpu/batch_check.py --check-batches 8 --check-steps 4 --skip-time
  done
elif [ "$1" = c ]; then
  export DS4_PDL=1
  DS4_PDL_EARLY=1 DS4_Q8_PREFETCH=1 DS4_HALF_PREFETCH=1 TAIL=4 run tests 240 python3 -m pytest -q \
    -p no:cacheprovider -p no:warnings tests/test_kernels_quant.py tests/test_kernels_side.py \
    tests/test_cuda_backend.py -k "q8_mv1 or hmatvec or official"
  for early in 0 1; do
    DS4_PDL_EARLY=$early TAIL=9 run "ab_early$early" 170 python3 tools/gpu/ab_decode.py --rounds 2 \
      --variants "q8 prefetch,prefetch"
  done
else
  TAIL=8 run sweep 300 python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 8192 \
    --step-mul 4 -n 64 --repeats 3 --prompt-file .gpu/shared/bench-text/promessi_sposi.txt --csv "$OUT/sweep.csv"
  TAIL=12 run batch 330 python3 tools/gpu/batch_check.py --batches 32 --check-batches 8,16 \
    --check-steps 4 --repeats 2 --plain
  TAIL=24 run profile "$(left)" python3 tools/gpu/profile_batch.py 32 8192
fi
