#!/bin/bash
# Device calls prepared in session 17 for what it built without device time (.gpu/shared carried):
#   part a: the HC post + next site's mixing partials in one launch (model.cuda.fused.HC_POST_MIX, off):
#           GPU tests of the fused HC kernels and the model, ab_decode at 4k, the B = 1 / 8 / 32 step,
#           the batched-vs-alone check with it on.
#   part b: the radix select keeping 16,384 scores in registers (topk.SELECT_REG_MAX): bench_topk_hc
#           (per call against the sort), ab_decode at 64k ctx with the decode step taking it ("select 16k").
# Usage: bash tools/gpu/session18.sh a|b
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
