#!/bin/bash
# Session 28: the mma gate/up with 16-byte loads and both nibble tables in 32 copies as the default (session
# 27's check passed with it on; per layer B = 32 373.0 us vs the dp4a kernel's 497.2, H100).
#   part a: the grouped GPU tests, the batched-vs-alone check at the new defaults (B = 1 / 3 / 16), whole
#           30-layer steps at B = 16 / 32 against the old default (grouped dp4a) and session 27's form
#           (grouped mma ld128: 16 copies), 3 rounds; where the B = 32 step's time goes now (graph_timeline).
#   part b (H200, the whole q2 model): B = 1 / 32 steps and the bars at the defaults (ds4-bench sweep 2k /
#           64k), then the grouped experts from 8 rows (B = 8 / 12 steps; the check at B = 8), then c.
#   part c: the mma gate/up at B = 1 / 2 / 4 / 8 per layer against the pair kernel (1 / 2 warps, fewer table
#           copies, the tables through L1).
#   part e: the grouped experts from 2 rows: 30-layer steps at B = 2 / 4 / 8, the check at B = 1 / 3 / 8.
#   part f (next): GPU tests, the check at B = 1 / 3 / 8 / 16 with the down's 64-row tile below 16 rows
#           (GroupedConfig.bn_pair_dn_small; built and timed, off until this passes).
#   part g (next): q8_rows at BN 128 (2 warps: 242 registers, no spills; sm_90 k loop 557 instructions for 64
#           weights a thread vs 349 for 32 at BN 64) on 30-layer B = 24 / 32 steps.
#   part h (next): the quad layout for the mma gate/up (GroupedConfig.quad_pack; sm_90 k loop 24 -> 8 loads
#           a lane and super-block, 8 shuffles, 152 -> 133 registers; and capped at 128): the GPU bit test
#           and the per-layer bench, then 20-layer B = 16 / 32 steps (both layouts held: 20 layers fit).
#   part d: Nsight Compute on q8_rows at B = 32 (q_b, o_b): stall reasons, shared wavefronts, SASS hot spots.
# Usage: bash tools/gpu/session28.sh a|b   (BUDGET: seconds for the call, 570 by default)
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=3 run tests 90 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py \
    -k "flash or variants or config"
  TAIL=8 run check 150 python3 tools/gpu/batch_check.py --skip-time --check-batches 1,3,16
  TAIL=10 run steps 150 python3 tools/gpu/batch_check.py --skip-check --layers 30 \
    --variants "${VARIANTS:-grouped dp4a,grouped mma ld128}" --batches 16,32 --ctx 8192 --steps 16 --rounds 3
  TAIL=40 run timeline "$(left)" python3 tools/gpu/graph_timeline.py --batch 32 --layers 30 --ctx 8192 --top 30
fi
if [ "$1" = b ]; then
  TAIL=10 run steps 120 python3 tools/gpu/batch_check.py --skip-check --batches 1,32 --ctx 8192 --steps 16
  TAIL=6 run sweep 200 python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 65536 \
    --step-mul 32 -n 64
  TAIL=8 run from8 120 python3 tools/gpu/batch_check.py --skip-check --variants "grouped from 8" --batches 8,12 \
    --ctx 8192 --steps 16 --rounds 2
  TAIL=8 run check8 100 env DS4_MOE_GROUPED_MIN_ROWS=8 python3 tools/gpu/batch_check.py --skip-time \
    --check-batches 8
  BUDGET=$(left) bash "$0" c
fi
if [ "$1" = c ]; then  # the mma gate/up at B = 1-8 against the pair kernel (the B = 1 decode's), per layer
  TAIL=40 run small "$(left)" python3 tools/gpu/bench_moe_grouped.py --pick=-4,-3,-2,-1 --batches=1,2,4,8 \
    "$OUT/small"
fi
if [ "$1" = d ]; then  # Nsight Compute on q8_rows at B = 32 (q_b, o_b): 15 % of a B = 32 step at ~0.6 TB/s
  NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
  TAIL=4 run ncu 150 env DS4_PDL=0 "$NCU" --clock-control none --profile-from-start off --kernel-name \
    regex:q8_rows --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section SourceCounters -f -o /tmp/rows python3 tools/gpu/ncu_probe.py
  "$NCU" --import /tmp/rows.ncu-rep --page details > "$OUT/rows_details.txt" 2>&1
  grep -E "^  [a-z_]+.*\(|Duration|Throughput|Registers|Achieved Occupancy|Eligible|Stall|Warp Cycles Per|Hit Rate|Excessive|Shared" \
    "$OUT/rows_details.txt" | head -80
  "$NCU" --import /tmp/rows.ncu-rep --page source --csv --print-source sass > /tmp/sass_rows.csv 2>&1
  python3 tools/gpu/ncu_top.py /tmp/sass_rows.csv 25 | tee "$OUT/top_rows.txt"
fi
if [ "$1" = e ]; then  # the grouped experts from 2 rows (part c: the mma gate/up beats the pair kernel at B >= 2)
  TAIL=8 run steps 150 python3 tools/gpu/batch_check.py --skip-check --layers 30 \
    --variants "grouped from 2,grouped from 2 dn64" --batches 2,4,8 --ctx 8192 --steps 16 --rounds 2
  TAIL=12 run check "$(left)" env DS4_MOE_GROUPED_MIN_ROWS=2 python3 tools/gpu/batch_check.py --skip-time \
    --check-batches 1,3,8
fi
if [ "$1" = f ]; then  # next: GPU tests, the check with the down's 64-row tile below 16 rows (off until it passes)
  TAIL=3 run tests 70 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py \
    -k "flash or small_rows or routed"
  TAIL=14 run check "$(left)" env DS4_MOE_GROUPED_BN_PAIR_DN_SMALL=64 python3 tools/gpu/batch_check.py \
    --skip-time --check-batches 1,3,8,16
fi
if [ "$1" = g ]; then  # next: q8_rows at 128 rows a program for B = 17-32 (x re-read half as often; d's counters)
  TAIL=8 run steps "$(left)" python3 tools/gpu/batch_check.py --skip-check --layers 30 \
    --variants "rows:bn=128,rows:bn=128+stages=4" --batches 24,32 --ctx 8192 --steps 16 --rounds 2
fi
if [ "$1" = h ]; then  # next: the quad layout for the mma gate/up (built, untimed): GPU bit test, per layer
  TAIL=3 run tests 80 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py \
    -k "quad or flash"
  TAIL=16 run bench 100 python3 tools/gpu/bench_moe_grouped.py --pick=-2,-1 "$OUT/qp"
  TAIL=8 run steps "$(left)" python3 tools/gpu/batch_check.py --skip-check --layers 20 --variants "grouped qp" \
    --batches 16,32 --ctx 8192 --steps 16 --rounds 2
fi
