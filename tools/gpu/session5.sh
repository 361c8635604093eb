#!/bin/bash
# Device calls for what session 5 built without a GPU (no device time was left): every new kernel and switch
# is tested and compiled for sm_90 here, none is timed. One part per call (each within the 10-minute limit):
#   part a: GPU tests of the changed kernels (q8_mv1 variants, q8_rows, the one-pass HC finish) and the
#           whole model vs the CPU reference, then their benches: bench_q8 --variants (B = 1), --rows
#           (B = 16/32/64: q8_rows vs the dense bf16 GEMM it replaced), bench_kernels --fused-only;
#   part b: batched decode with q8_rows (check B = 8, 16 against the 2e-2 bar that B = 16 failed in session
#           4; time B = 1, 16, 32, and B = 32 on the old dense path), then the whole-model A/B of the
#           switches (tools/gpu/ab_decode.py) and the ds4-bench sweep 2k -> 8k (2 repeats, medians).
#   part c: programmatic dependent launch (DS4_PDL=1: the decode kernels launched with launch_pdl, each waiting
#           for its predecessor first): the kernel and model GPU tests under it, then decode with and without
#           it in two processes (tools/gpu/ab_decode.py, the "default" rows compare).
# Then: flip the defaults whose VERDICT says faster (matvec.Q8_MV1, fused.HC_FINISH_BD / _WARPS,
# layer.INDEXER_TOPK), and revert layer.BATCH_QROWS to 0 if bench_q8 --rows / batch_check say q8_rows is slower
# than the dense path by more than its precision is worth. Needs .gpu/shared carried (fixtures + bench text):
#   mkdir -p .gpu/shared/fixtures/official-tiny .gpu/shared/bench-text
#   cp ../shared/fixtures/official-tiny/{cases.json,logits.npz,model.gguf.xz,model-q8.gguf.xz} \
#      .gpu/shared/fixtures/official-tiny/; cp ../shared/bench-text/promessi_sposi.txt .gpu/shared/bench-text/
# then run(command="bash tools/gpu/session5.sh a", carry=[".gpu"]). Logs land in $OUT.
# Usage: bash tools/gpu/session5.sh a|b|c
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=8 run ktests 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_quant.py \
    tests/test_kernels_fused.py -k "q8 or magic or fixup or flash or hc_pre"
  TAIL=8 run model 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_cuda_backend.py \
    tests/test_cuda_batch.py
  TAIL=14 run q8var 70 python3 tools/gpu/bench_q8.py --variants
  TAIL=36 run q8rows 110 python3 tools/gpu/bench_q8.py --rows
  TAIL=10 run fused "$(left)" python3 tools/gpu/bench_kernels.py --fused-only
elif [ "$1" = c ]; then
  TAIL=8 run pdltests 240 env DS4_PDL=1 python3 -m pytest -q -p no:cacheprovider -p no:warnings \
    tests/test_kernels_quant.py tests/test_kernels_fused.py tests/test_kernels_attend.py \
    tests/test_kernels_compress.py tests/test_kernels_moe.py tests/test_kernels_moe_grouped.py \
    tests/test_cuda_backend.py tests/test_cuda_batch.py
  TAIL=10 run ab_pdl 150 env DS4_PDL=1 python3 tools/gpu/ab_decode.py --rounds 2
  TAIL=10 run ab_plain "$(left)" python3 tools/gpu/ab_decode.py --rounds 2
else
  TAIL=22 run batch 260 python3 tools/gpu/batch_check.py --batches 1,16,32 --check-batches 8,16 \
    --check-steps 4 --repeats 2 --plain
  TAIL=4 run batchold 90 env DS4_BATCH_QROWS=0 python3 tools/gpu/batch_check.py --skip-check --batches 32 \
    --repeats 2 --plain
  TAIL=16 run ab 150 python3 tools/gpu/ab_decode.py --rounds 3
  TAIL=8 run sweep "$(left)" python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 8192 \
    --step-mul 4 -n 64 --repeats 2 --prompt-file .gpu/shared/bench-text/promessi_sposi.txt --csv "$OUT/sweep.csv"
fi
