#!/bin/bash
# Device calls of the fourth session, one part per call (each within the 10-minute limit):
#   part x: (nvidia-h200-x2) issue 9's expert-parallel check (tools/gpu/ep_check.py: q2 on 1 GPU vs 2, q4 on
#           2), then as much of the kernel + whole-model GPU tests as the call's time leaves;
#   part y: (nvidia-h200-x2) the expert-parallel check again after the per-slot combine, the Q8_0 split-K
#           fixup and prefill indexer kernel tests + benches, then where decode / 8k prefill time goes;
#   part f: (final) the 4-layer Flash-width model vs the CPU reference (the rest of test_cuda_backend passed
#           in part g), the ds4-bench sweep 2k -> 8k, batched decode B = 1 / 32 at 8k (checks at B = 8, 16);
#   part g: the new kernels' GPU tests + the whole model vs the CPU reference, then the grouped-expert and
#           B <= 4 expert-variant benches (to set defaults before part f's end-to-end numbers);
#   part t: the kernel + whole-model GPU tests, then decode tok/s at 2k/64k (tools/gpu/quick_decode.py).
# Needs .gpu/shared carried (fixtures + bench text). Logs land in $OUT.  Usage: bash tools/gpu/session4.sh x|t
source "$(dirname "$0")/session_lib.sh"
export NCCL_NVLS_ENABLE=0  # NVLink multicast off (device notes)
TESTS="tests/test_kernels_attend.py tests/test_kernels_side.py tests/test_kernels_compress.py
  tests/test_kernels_prefill.py tests/test_kernels_attend_prefill.py tests/test_kernels_moe.py
  tests/test_kernels_fused.py tests/test_cuda_backend.py tests/test_cuda_batch.py"
if [ "$1" = x ]; then
  TAIL=24 run ep 420 torchrun --standalone --nproc-per-node 2 tools/gpu/ep_check.py --prompt 4096 --steps 32 \
    --decode 64 --json "$OUT/ep.json"
  TAIL=12 run tests "$(left)" python3 -m pytest -q -p no:cacheprovider -p no:warnings $TESTS
elif [ "$1" = y ]; then
  TAIL=16 run ep 200 torchrun --standalone --nproc-per-node 2 tools/gpu/ep_check.py --prompt 4096 --steps 32 \
    --decode 64 --json "$OUT/ep.json"
  TAIL=8 run ktests 120 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_quant.py \
    tests/test_kernels_indexer_prefill.py
  TAIL=30 run q8 90 python3 tools/gpu/bench_q8.py
  TAIL=20 run pidx 60 python3 tools/gpu/bench_indexer_prefill.py
  TAIL=75 run profile "$(left)" python3 tools/gpu/profile_regions.py 8192
elif [ "$1" = g ]; then
  TAIL=10 run ktests 100 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_attend.py \
    tests/test_kernels_quant.py tests/test_kernels_moe_grouped.py tests/test_kernels_indexer_prefill.py \
    tests/test_kernels_moe.py -k "indexer or fixup or flash or graph or grouped or pair or variants"
  TAIL=8 run model 120 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_cuda_backend.py
  TAIL=30 run mgroup 60 python3 tools/gpu/bench_moe_grouped.py "$OUT"
  TAIL=30 run moe1 "$(left)" python3 tools/gpu/bench_moe.py --quick "$OUT"
elif [ "$1" = f ]; then
  TAIL=8 run model 200 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_cuda_backend.py \
    -k flash_width
  TAIL=8 run sweep 110 python3 -m ds4.bench --synthetic flash-q2 --ctx-start 2048 --ctx-max 8192 --step-mul 4 \
    -n 64 --prompt-file .gpu/shared/bench-text/promessi_sposi.txt --csv "$OUT/sweep.csv"
  TAIL=24 run batch "$(left)" python3 tools/gpu/batch_check.py --batches 1,32 --check-batches 8,16 \
    --check-steps 4 --repeats 2 --plain
else
  TAIL=12 run tests 360 python3 -m pytest -q -p no:cacheprovider -p no:warnings $TESTS
  run decode "$(left)" python3 tools/gpu/quick_decode.py q2
fi
