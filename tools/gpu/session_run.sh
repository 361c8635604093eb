#!/bin/bash
# Device calls of this session's GPU work, one part per call (each fits the 10-minute limit on one H200):
#   part a: device tests (kernels, batched decode, cuda backend), then the batched decode check + timing
#           (tools/gpu/batch_check.py), with the torch 2.11 test diagnostic on the CPU alongside;
#   part b: the MoE kernel bench, decode with the int8 expert kernels (DS4_MOE_INT8=1), and
#           ds4-bench --parallel 32 at 8k (aggregate decode + TTFT of a new request while 31 stream).
# Needs .gpu/shared carried (fixtures + bench text). Logs land in $OUT.  Usage: bash tools/gpu/session_run.sh a|b
export PYTHONPATH=. PYTHONUNBUFFERED=1 DS4_SHARED=$PWD/.gpu/shared DS4_TEST_CACHE=/tmp/ds4-cache NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/extra"
if [ "$1" = a ]; then
  (timeout 150 python3 tools/gpu/diag_t211.py > "$OUT/t211.log" 2>&1) &
  timeout 220 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_moe.py tests/test_cuda_batch.py \
    tests/test_cuda_backend.py > "$OUT/tests.log" 2>&1
  timeout 300 python3 tools/gpu/batch_check.py > "$OUT/batch.log" 2>&1
  wait
  logs="tests batch t211"
else
  timeout 120 python3 tools/gpu/bench_moe.py "$OUT/extra" > "$OUT/moe.log" 2>&1
  DS4_MOE_INT8=1 timeout 110 python3 tools/gpu/quick_decode.py q2 > "$OUT/decode_int8.log" 2>&1
  timeout 200 python3 -m ds4.bench --synthetic flash-q2 --parallel 32 --ctx-start 8192 --ctx-max 8192 -n 32 \
    --ttft-prompt 1024 --prefill-budget 512 --csv "$OUT/extra/par32.csv" > "$OUT/par32.log" 2>&1
  logs="moe decode_int8 par32"
fi
for f in $logs; do echo "=== $f"; tail -n 30 "$OUT/$f.log"; done
