#!/bin/bash
# One device call: cuda backend tests, then the full-size speed probe + bench sweep. Needs .gpu/shared
# (fixtures + bench text, see BENCHMARKS.md) carried along. Usage: bash tools/gpu/run_cuda.sh [quant] [bench-ctx-max]
export PYTHONPATH=. PYTHONUNBUFFERED=1 DS4_SHARED=$PWD/.gpu/shared DS4_TEST_CACHE=/tmp/ds4-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
DS4_COMPILE=0 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_backend.py 2>&1 | tee "$OUT/tests.log" | tail -25
timeout ${PROBE_TIMEOUT:-300} python3 tools/gpu/cuda_probe.py "$OUT" "${1:-q2}" "${2:-16384}" 2>&1 | tee "$OUT/probe.log" | tail -80
