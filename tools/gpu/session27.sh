#!/bin/bash
# Session 27: the open timings of sessions 25 and 26 in one short call (H100 or H200, per layer), then more
# as the budget allows.
#   part a: the Flash-width grouped GPU tests (mma, ld128, down), the per-layer bench of the gate/up capped
#           at 64 registers (occupancy: 8 programs an SM instead of 6) and the mma kernels with 16-byte loads
#           (is the L1 sector use what bounds them?), then 30-layer B = 16 / 32 steps with the r64 variants.
#   part b (H200, the whole q2 model): the bars at the defaults (ds4-bench sweep 2k / 64k) and B = 1 / 32.
#   part d: the mma gate/up with 16-byte loads (part a: x1.195 per layer at B = 32) and its 32-copy /
#           8-warp forms per layer, the mma down rebuilt around 16-byte loads (15 loads a lane and
#           super-block instead of 35), both on whole 30-layer steps, the batched-vs-alone check.
#   part c: Nsight Compute on the B = 32 grouped kernels (ncu_probe.py --grouped): stall reasons, dp4a vs mma.
#   part e: part d without the per-layer bench (a near-spent budget; its check was cut at the budget).
#   part f (next): the grouped GPU tests, the batched-vs-alone check with the mma ld128 gate/up on, the
#           per-layer bench of the untimed builds against mma ld128 (32 grid copies at 4 / 8 warps, 8 warps,
#           both tables in 32 copies at 4 / 8 warps, the sign nibbles by one permute for the mma and the
#           dp4a kernel, the rebuilt mma down), then 3 rounds of steps.
# Usage: bash tools/gpu/session27.sh a|b|c|d|e|f   (BUDGET: seconds for the call, 570 by default)
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=3 run tests 100 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py \
    -k "flash"
  TAIL=30 run bench1 110 python3 tools/gpu/bench_moe_grouped.py --pick=-14,-13,-12,-8,-7,-5,-4 "$OUT/b1"
  TAIL=12 run steps "$(left)" python3 tools/gpu/batch_check.py --skip-check --layers 30 \
    --variants "${VARIANTS:-grouped r64,grouped math r64}" --batches 16,32 --ctx 8192 --steps 16
fi
if [ "$1" = b ]; then
  TAIL=6 run sweep 200 python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 65536 \
    --step-mul 32 -n 64
  TAIL=10 run steps "$(left)" python3 tools/gpu/batch_check.py --skip-check --batches 1,32 --ctx 8192 --steps 16
fi
if [ "$1" = c ]; then  # Nsight Compute: stall reasons of the B = 32 grouped kernels, dp4a vs mma (ncu_probe)
  NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
  TAIL=4 run ncu 200 env DS4_PDL=0 "$NCU" --clock-control none --profile-from-start off --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section SourceCounters \
    -f -o /tmp/probe python3 tools/gpu/ncu_probe.py --grouped
  "$NCU" --import /tmp/probe.ncu-rep --page details > "$OUT/details.txt" 2>&1
  grep -E "^  [a-z_]+.*\(|Duration|Throughput|Registers|Achieved Occupancy|Eligible|Stall|Warp Cycles Per|Hit Rate" \
    "$OUT/details.txt" | head -120
  for k in gate_up_grouped gate_up_mma down_mma q2k_q8k_down; do
    "$NCU" --import /tmp/probe.ncu-rep --page source --csv --print-source sass --kernel-name "regex:$k" \
      > "/tmp/sass_$k.csv" 2>&1
    python3 tools/gpu/ncu_top.py "/tmp/sass_$k.csv" 25 | tee "$OUT/top_$k.txt"
  done
fi
if [ "$1" = d ]; then  # part a's winner on whole steps: the mma gate/up with 16-byte loads (x1.195 per layer)
  TAIL=3 run tests 60 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py \
    -k "flash"
  TAIL=16 run bench1 80 python3 tools/gpu/bench_moe_grouped.py --pick=-4,-3,-2,-1 "$OUT/b1"
  TAIL=8 run steps 150 python3 tools/gpu/batch_check.py --skip-check --layers 30 \
    --variants "${VARIANTS:-grouped mma ld128,grouped mma both ld128}" --batches 16,32 --ctx 8192 --steps 16
  TAIL=8 run check "$(left)" env DS4_MOE_GROUPED_MMA=1 DS4_MOE_GROUPED_MMA_LD128=1 DS4_MOE_GROUPED_MMA_DN=1 python3 tools/gpu/batch_check.py \
    --skip-time --check-batches 1,3,16
fi
if [ "$1" = e ]; then  # part d cut to what a near-spent budget allows: correctness, whole steps, the check
  TAIL=3 run tests 45 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py \
    -k "flash"
  TAIL=8 run steps 110 python3 tools/gpu/batch_check.py --skip-check --layers 30 \
    --variants "grouped mma ld128,grouped mma both ld128" --batches 16,32 --ctx 8192 --steps 16
  TAIL=8 run check "$(left)" env DS4_MOE_GROUPED_MMA=1 DS4_MOE_GROUPED_MMA_LD128=1 DS4_MOE_GROUPED_MMA_DN=1 \
    python3 tools/gpu/batch_check.py --skip-time --check-batches 1,16
fi
if [ "$1" = f ]; then  # next: the check with the mma ld128 gate/up on, the untimed builds, 3 rounds of steps
  TAIL=3 run tests 90 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py \
    -k "flash or variants"
  TAIL=8 run check 200 env DS4_MOE_GROUPED_MMA=1 DS4_MOE_GROUPED_MMA_LD128=1 python3 tools/gpu/batch_check.py \
    --skip-time --check-batches 1,3,16
  TAIL=20 run bench1 90 python3 tools/gpu/bench_moe_grouped.py --pick=-8,-7,-6,-5,-4,-3,-2,-1 "$OUT/b1"
  TAIL=8 run steps "$(left)" python3 tools/gpu/batch_check.py --skip-check --layers 30 \
    --variants "${VARIANTS:-grouped mma ld128}" --batches 16,32 --ctx 8192 --steps 16 --rounds 3
fi
