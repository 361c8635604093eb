#!/bin/bash
# One device call on nvidia-h200-x2 (two GPUs used side by side):
#   GPU 1: device tests (kernels, batched decode, cuda backend), the MoE kernel bench, decode with the int8
#          expert kernels (DS4_MOE_INT8=1);
#   GPU 0: batched decode check + timing (tools/gpu/batch_check.py);
#   CPU:   the torch 2.11 test diagnostic.
# Needs .gpu/shared carried (fixtures + bench text). Logs land in $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1 DS4_SHARED=$PWD/.gpu/shared DS4_TEST_CACHE=/tmp/ds4-cache NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/moe"
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 210 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_moe.py tests/test_cuda_batch.py \
    tests/test_cuda_backend.py > "$OUT/tests.log" 2>&1
  timeout 120 python3 tools/gpu/bench_moe.py "$OUT/moe" > "$OUT/moe.log" 2>&1
  DS4_MOE_INT8=1 timeout 110 python3 tools/gpu/quick_decode.py q2 > "$OUT/decode_int8.log" 2>&1
) &
(timeout 120 python3 tools/gpu/diag_t211.py > "$OUT/t211.log" 2>&1) &
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 330 python3 tools/gpu/batch_check.py > "$OUT/batch.log" 2>&1
  timeout 150 python3 -m ds4.bench --synthetic flash-q2 --parallel 32 --ctx-start 8192 --ctx-max 8192 -n 32 \
    --ttft-prompt 1024 --prefill-budget 512 --csv "$OUT/moe/par32.csv" > "$OUT/par32.log" 2>&1
)
wait
for f in tests moe decode_int8 batch par32 t211; do echo "=== $f"; tail -n 25 "$OUT/$f.log"; done
