#!/bin/bash
# One device call for the batch-1 decode work (issue 5): tune/check the decode kernels, the GPU tests
# (kernels + cuda backend vs the official-tiny fixtures), then decode tok/s at 2k and 64k with the best MoE
# launch shapes. Needs .gpu/shared carried (see BENCHMARKS.md). Usage: bash tools/gpu/run_decode.sh
export PYTHONPATH=. PYTHONUNBUFFERED=1 DS4_SHARED=$PWD/.gpu/shared DS4_TEST_CACHE=/tmp/ds4-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
timeout ${TUNE_S:-100} python3 tools/gpu/tune_decode.py "$OUT" --quick > "$OUT/tune.log" 2>&1; echo "tune rc $?"
sed -n '/^experts/,$p' "$OUT/tune.log" | grep -v "^  "
DS4_COMPILE=0 timeout ${TEST_S:-170} python3 -m pytest -q -p no:cacheprovider tests/test_kernels_quant.py \
  tests/test_kernels_moe.py tests/test_kernels_hc.py tests/test_cuda_backend.py > "$OUT/tests.log" 2>&1
echo "tests rc $?"; grep -E "passed|failed|^FAILED" "$OUT/tests.log"
timeout ${DECODE_S:-200} python3 tools/gpu/quick_decode.py q2 "$OUT/best_moe.json" "$OUT/profile.txt" 2>&1 | tee "$OUT/decode.log" | tail -4
