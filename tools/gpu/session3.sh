#!/bin/bash
# Device calls of the third session's issue-5/8 work, one part per call (each within the 10-minute limit):
#   part k: the new kernels compiled for sm_90 and checked against their twins (kernel test modules), then
#           their benches (side matvec, MoE int8 one/two-term, prefill experts, prefill attention) and
#           decode tok/s at 2k/64k through the new decode wiring (tools/gpu/quick_decode.py);
#   part t: every new kernel test module compiled, plus the whole model on the GPU vs the CPU reference
#           (tests/test_cuda_backend.py incl. the official-tiny cases and the 4-layer Flash-width model,
#           test_cuda_batch.py), then decode tok/s at 2k/64k;
#   part e: the decode step and the 8k prefill by region (profile_regions.py), batched decode timing
#           (batch_check.py), ds4-bench --parallel 32 at 8k (aggregate + TTFT of a new request under load).
# Needs .gpu/shared carried (fixtures + bench text). Logs land in $OUT.  Usage: bash tools/gpu/session3.sh k|t|e
export PYTHONPATH=. PYTHONUNBUFFERED=1 DS4_SHARED=$PWD/.gpu/shared DS4_TEST_CACHE=/tmp/ds4-cache
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
run() {  # run NAME SECONDS CMD...: log to $OUT/NAME.log, print its tail
  local name=$1 secs=$2
  shift 2
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name (rc $?)"
  grep -v -i "warn" "$OUT/$name.log" | tail -n "${TAIL:-14}"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
if [ "$1" = k ]; then
  TAIL=8 run ktests 240 python3 -m pytest -q -p no:cacheprovider -p no:warnings -x --maxfail=20 \
    tests/test_kernels_attend.py tests/test_kernels_side.py tests/test_kernels_compress.py \
    tests/test_kernels_prefill.py tests/test_kernels_attend_prefill.py tests/test_kernels_moe.py \
    tests/test_kernels_fused.py
  run side 60 python3 tools/gpu/bench_side.py --quick
  run moe 60 python3 tools/gpu/bench_moe.py "$OUT"
  run pmoe 60 python3 tools/gpu/bench_prefill_moe.py
  run pattn 60 python3 tools/gpu/bench_attend_prefill.py
  run decode 110 python3 tools/gpu/quick_decode.py q2
elif [ "$1" = t ]; then  # tests of the whole change, then decode tok/s
  TAIL=10 run tests 330 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_attend.py \
    tests/test_kernels_side.py tests/test_kernels_compress.py tests/test_kernels_prefill.py \
    tests/test_kernels_attend_prefill.py tests/test_kernels_moe.py tests/test_cuda_backend.py \
    tests/test_cuda_batch.py
  run decode 130 python3 tools/gpu/quick_decode.py q2
else  # where the time goes now, batched decode, TTFT under load
  TAIL=75 run profile 170 python3 tools/gpu/profile_regions.py 8192
  run batch 200 python3 tools/gpu/batch_check.py --skip-check
  run par32 170 python3 -m ds4.bench --synthetic flash-q2 --parallel 32 --ctx-start 8192 --ctx-max 8192 -n 32 \
    --ttft-prompt 1024 --prefill-budget 512 --csv "$OUT/par32.csv"
fi
