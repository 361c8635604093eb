#!/bin/bash
# Device calls prepared in session 9 (after its GPU time was spent), one part per call:
#   part a: the correctness of session 9's prefill path on the GPU, which session 9 could not run with its
#           final defaults: tests/test_cuda_backend.py (official cases, the 4-layer full-width check, replay),
#           the kernel tests of the new pieces (o_unrope, q_norm_rope on bf16 input, the bf16 store rounding,
#           linear_f32, indexer_q, gather_sum, the bf16 SwiGLU output).
#   part b: prefill: bench_prefill_f32.py (linear_f32 tiles incl. 8 warps / 5 stages, HC row tiles at 8 warps),
#           prefill_ab.py 8192 (each switch, all, all but each; session 9: all = 1.686-1.768 s), the
#           ds4-bench 8k-from-empty figure (session 9: 4,824 tok/s; bar 5,000), the 2k -> 8k sweep (decode
#           103.33 / 101.76 tok/s).
#   part c: decode A/B of the two new launch cuts (step memo of the ring rows, the indexer query kernel; both
#           on), a B = 32 step (session 9: 63.17 ms), where the 8k prefill's time goes now (profile_regions.py).
# Needs .gpu/shared carried (see session5.sh). Usage: bash tools/gpu/session10.sh a|b|c
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=8 run backend 330 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_cuda_backend.py
  TAIL=6 run kernels "$(left)" python3 -m pytest -q -p no:cacheprovider -p no:warnings \
    tests/test_kernels_fused.py tests/test_kernels_gemm.py tests/test_kernels_compress.py tests/test_kernels_prefill.py
elif [ "$1" = b ]; then
  TAIL=40 run bench_f32 90 python3 tools/gpu/bench_prefill_f32.py
  TAIL=14 run prefill_ab 200 python3 tools/gpu/prefill_ab.py 8192
  TAIL=4 run bench8k 90 python3 -m ds4.bench --synthetic flash-q2 --ctx-start 8192 --ctx-max 8192 -n 16 \
    --repeats 2 --prompt-file .gpu/shared/bench-text/promessi_sposi.txt --csv "$OUT/bench8k.csv"
  TAIL=6 run sweep 110 python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 8192 \
    --step-mul 4 -n 64 --repeats 3 --prompt-file .gpu/shared/bench-text/promessi_sposi.txt --csv "$OUT/sweep.csv"
else
  TAIL=8 run ab 260 python3 tools/gpu/ab_decode.py --rounds 2 --variants "no step memo,indexer q torch"
  TAIL=3 run b32 150 python3 tools/gpu/batch_check.py --batches 32 --skip-check --repeats 2 --plain
  TAIL=40 run profile "$(left)" python3 tools/gpu/profile_regions.py 8192
fi
