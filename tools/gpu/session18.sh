#!/bin/bash
# Device calls prepared in session 17 for what it built without device time (.gpu/shared carried):
#   part a: the HC post + next site's mixing partials in one launch (model.cuda.fused.HC_POST_MIX, off):
#           GPU tests of the fused HC kernels and the model, ab_decode at 4k, the B = 1 / 8 / 32 step,
#           the batched-vs-alone check with it on.
#   part b: the radix select keeping 16,384 scores in registers (topk.SELECT_REG_MAX): bench_topk_hc
#           (per call against the sort), ab_decode at 64k ctx with the decode step taking it ("select 16k").
#   part c: this session's launches off the step's critical path (the q_a norm in the kv row's kernel, the
#           routed experts' Q8_K input from the HC finish, the indexer weights' scale in its kernel, the
#           compressor chain on side lane 3): GPU
#           tests of those kernels and the model, ab_decode at 4k with each switched back, the
#           batched-vs-alone check, the B = 1 / 8 / 32 step.
#   part d: the model's GPU tests with part c's defaults (part c's run stopped them at its time limit),
#           ab_decode at 8k with the compressor chain on the main stream / the routed experts' Q8_K
#           launch on side lane 3, the ds4-bench sweep 2k / 64k and ds4-bench at 32 streams.
# Usage: bash tools/gpu/session18.sh a|b|c|d
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=4 run tests 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_fused.py \
    -k "hc_post or hc_pre"
  TAIL=8 run ab 130 python3 tools/gpu/ab_decode.py --rounds 2 --variants "hc post mix"
  TAIL=12 run step 150 python3 tools/gpu/batch_check.py --skip-check --batches 1,8,32 --steps 16 \
    --variants "default,hc post mix"
  TAIL=14 run check "$(left)" env DS4_HC_POST_MIX=1 python3 tools/gpu/batch_check.py --skip-time \
    --check-batches 1,3,8
fi
if [ "$1" = b ]; then
  TAIL=4 run tests 60 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_topk.py
  TAIL=12 run bench 60 python3 tools/gpu/bench_topk_hc.py
  TAIL=8 run ab64k "$(left)" python3 tools/gpu/ab_decode.py --ctx 65536 --rounds 2 --variants "select 16k"
fi
if [ "$1" = c ]; then
  TAIL=4 run tests 200 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_fused.py \
    tests/test_kernels_attend.py tests/test_kernels_moe.py tests/test_kernels_moe_grouped.py \
    -k "quant or kv_norm or indexer_scores or hc_pre or given_planes"
  TAIL=4 run model 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_cuda_backend.py \
    -k "official or flash_width or side_stream"
  # (run in session 18 as "q8k apart" while the finish's Q8_K planes were the default; now "q8k in finish")
  TAIL=10 run ab 170 python3 tools/gpu/ab_decode.py --rounds 2 --variants "qa norm apart,q8k in finish,comp main"
  TAIL=14 run check 90 python3 tools/gpu/batch_check.py --skip-time --check-batches 1,3,8,16
  TAIL=12 run step "$(left)" python3 tools/gpu/batch_check.py --skip-check --batches 1,8,32 --steps 16 \
    --variants "default,comp main"
fi
if [ "$1" = d ]; then
  TAIL=4 run model 170 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_cuda_backend.py \
    -k "official or flash_width or side_stream"
  TAIL=8 run ab8k 100 python3 tools/gpu/ab_decode.py --ctx 8192 --rounds 2 --variants "comp main,q8k side"
  TAIL=6 run sweep 150 python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 65536 --step-mul 32 -n 64
  TAIL=4 run bench32 "$(left)" python3 -m ds4.bench --synthetic flash-q2 --parallel 32 --ctx-start 8192 \
    --ctx-max 8192 -n 32 --ttft-prompt 1024 --prefill-budget 512
fi
