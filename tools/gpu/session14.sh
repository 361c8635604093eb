#!/bin/bash
# Device calls of session 14, one part per call (.gpu/shared carried, see session5.sh):
#   part a: Nsight Compute on the kernels that bound issues 5 and 8 (tools/gpu/ncu_probe.py: routed experts
#           at B = 32 grouped and B = 1 pairs, Q8_0 at B = 1 and 32): speed of light, occupancy, warp
#           stall reasons, and the SASS lines with the most stall samples; then bench_q8 --rows (BN 128).
#   part b: the routed-expert kernels' loads coalesced (moe._iq2_load / _q2k_block / _q2k_scales, the grid
#           gathers by _signed_words_sb): GPU tests, bench_moe_grouped.py (B = 8 / 16 / 32 per layer),
#           bench_moe.py --quick (B = 1), and Nsight Compute again on the probe (L1 tag requests).
#   part c: the same change on the whole model, with the batched step's down by the pair kernel
#           (GroupedConfig.pair_down) and gathered sign nibbles: grouped-kernel tests, decode at 4k ctx
#           (B = 1), the B = 16 / 32 step against both old choices, the batched-vs-alone check.
#   part d: the batched-vs-alone check with the integer batch-1 Q8_0 matvec on (DS4_Q8_INT8=1), then the
#           TTFT of a new request while 31 others stream (ds4-bench --parallel 32).
#   part e: the ds4-bench sweep at 2k and 64k ctx, and where a B = 32 step goes now (profile_batch.py).
#   part f: Nsight Compute again with the per-SASS pages of the five decode kernels, as one tarball.
#   part g: the IQ2_XXS byte permutes from the 16-bit code table (prmt with grid16: 512 B, half the lines
#           per gather, +6 ALU ops per group): variant tests, bench_moe_grouped, bench_moe --quick, the
#           whole model at B = 1 and the B = 32 step.
# Usage: bash tools/gpu/session14.sh a|b|c|d|e|f|g
source "$(dirname "$0")/session_lib.sh"
NCU_SECTIONS="--section SpeedOfLight --section LaunchStats --section Occupancy --section SchedulerStats \
 --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
 --section InstructionStats --section SourceCounters"
if [ "$1" = a ]; then
  which ncu || ls /opt/nvidia/nsight-compute/*/ncu
  NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
  # shellcheck disable=SC2086
  TAIL=4 run ncu 300 env DS4_PDL=0 "$NCU" --clock-control none --profile-from-start off $NCU_SECTIONS \
    -f -o "$OUT/probe" python3 tools/gpu/ncu_probe.py
  "$NCU" --import "$OUT/probe.ncu-rep" --page details > "$OUT/details.txt" 2>&1
  grep -E "^  [a-z_]+.*\(|Duration|Throughput|Registers|Achieved Occupancy|Issue Slots|No Eligible|Stall|Warp Cycles Per Issued|Theoretical Occ|Block Limit" "$OUT/details.txt" | head -150
  for k in gate_up_grouped down_grouped q8_rows q8_mv1 iq2; do
    "$NCU" --import "$OUT/probe.ncu-rep" --page source --csv --print-source sass --kernel-name "regex:$k" \
      > "$OUT/sass_$k.csv" 2> "$OUT/sass_$k.err" || head -c 600 "$OUT/sass_$k.err"
  done
  ls -la "$OUT"
  TAIL=24 run rows "$(left)" python3 tools/gpu/bench_q8.py --rows
fi
if [ "$1" = b ]; then
  TAIL=6 run tests 170 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe.py \
    tests/test_kernels_moe_grouped.py
  TAIL=40 run grouped 110 python3 tools/gpu/bench_moe_grouped.py
  TAIL=30 run pair 100 python3 tools/gpu/bench_moe.py --quick
  NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
  TAIL=3 run ncu "$(left)" env DS4_PDL=0 "$NCU" --clock-control none --profile-from-start off \
    --section SpeedOfLight --section Occupancy --section SourceCounters --section LaunchStats \
    -f -o "$OUT/probe" python3 tools/gpu/ncu_probe.py
  "$NCU" --import "$OUT/probe.ncu-rep" --page details > "$OUT/details.txt" 2>&1
  rm -f "$OUT/probe.ncu-rep"
  grep -E "^  [_a-z].*Context|Duration|L1/TEX Cache Throughput|Compute \(SM\)|Registers Per|Achieved Occ|excessive" \
    "$OUT/details.txt" | grep -v "at::" | cut -c1-120 | head -80
fi
if [ "$1" = c ]; then
  TAIL=4 run tests 80 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe_grouped.py
  TAIL=8 run ab 180 python3 tools/gpu/ab_decode.py --rounds 2 --variants "q8 int8 bn4"
  TAIL=12 run step 190 python3 tools/gpu/batch_check.py --skip-check --batches 16,32 --steps 16 \
    --variants "grouped down,grouped sign math"
  TAIL=14 run check "$(left)" python3 tools/gpu/batch_check.py --skip-time --check-batches 1,3,8,16
fi
if [ "$1" = d ]; then
  TAIL=14 run check_int8 150 env DS4_Q8_INT8=1 python3 tools/gpu/batch_check.py --skip-time --check-batches 1,3,8,16
  TAIL=12 run ttft 330 python3 -m ds4.bench --synthetic flash-q2 --parallel 32 --ctx-start 8192 \
    --ctx-max 8192 -n 32 --ttft-prompt 1024 --prefill-budget 512
fi
if [ "$1" = e ]; then
  TAIL=8 run sweep 240 python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 65536 --step-mul 32 -n 64
  TAIL=40 run profile32 200 env DS4_PDL=0 python3 tools/gpu/profile_batch.py 32 8192
fi
if [ "$1" = f ]; then
  NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
  # shellcheck disable=SC2086
  TAIL=3 run ncu 300 env DS4_PDL=0 "$NCU" --clock-control none --profile-from-start off $NCU_SECTIONS \
    -f -o /tmp/p2 python3 tools/gpu/ncu_probe.py
  mkdir -p /tmp/s
  "$NCU" --import /tmp/p2.ncu-rep --page details > /tmp/s/details.txt 2>&1
  for k in gate_up_grouped q2k_q8k_down q8_rows q8_mv1 iq2_q8k_gate_up; do
    "$NCU" --import /tmp/p2.ncu-rep --page source --csv --print-source sass --kernel-name "regex:$k" \
      > "/tmp/s/sass_$k.csv" 2> /dev/null
  done
  tar czf "$OUT/ncu14.tgz" -C /tmp/s .  # one file: the device returns a handful of files per call
fi
if [ "$1" = g ]; then
  TAIL=4 run tests 90 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_moe.py \
    tests/test_kernels_moe_grouped.py -k "variants or spread or flash"
  TAIL=12 run grouped 60 sh -c "python3 tools/gpu/bench_moe_grouped.py | grep -E 'B = |prmt|per layer'"
  TAIL=8 run pair 60 sh -c "python3 tools/gpu/bench_moe.py --quick | grep -E 'B = |prmt|VERDICT'"
  TAIL=6 run ab 120 python3 tools/gpu/ab_decode.py --rounds 2 --variants "moe prmt16"
  TAIL=6 run step "$(left)" python3 tools/gpu/batch_check.py --skip-check --batches 32 --steps 16 \
    --variants "grouped prmt16"
fi
