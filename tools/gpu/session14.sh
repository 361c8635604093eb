#!/bin/bash
# Device calls of session 14, one part per call (.gpu/shared carried, see session5.sh):
#   part a: Nsight Compute on the kernels that bound issues 5 and 8 (tools/gpu/ncu_probe.py: routed experts
#           at B = 32 grouped and B = 1 pairs, Q8_0 at B = 1 and 32): speed of light, occupancy, warp
#           stall reasons, and the SASS lines with the most stall samples; then bench_q8 --rows (BN 128).
# Usage: bash tools/gpu/session14.sh a
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
