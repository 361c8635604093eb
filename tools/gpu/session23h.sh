#!/bin/bash
# Session 23's first H100 call (the H200 did not come): what does not need the whole model. The GPU tests
# of the tail kernels (machine-independent correctness), then the A/B ratios of the fused tail and of
# merged rows up to 64 on the first 30 of the 43 layers (ds4.bench.first_layers; q2 at 43 layers does not
# fit 78 GiB); per-step microseconds carry over, ratios to the H200 only roughly. It ran with both off and
# the variants "tail fused" / "merged rows 64"; both are defaults since, so the variants are now the old
# settings ("tail torch" / "merged rows 8"). Usage: bash tools/gpu/session23h.sh
source "$(dirname "$0")/session_lib.sh"
TAIL=3 run tests 120 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_kernels_fused.py \
  tests/test_cuda_backend.py -k "tail or hash or head or flash_shapes or official"
TAIL=8 run ab 170 python3 tools/gpu/ab_decode.py --layers 30 --rounds 3 --variants "tail torch"
TAIL=12 run steps "$(left)" python3 tools/gpu/batch_check.py --skip-check --layers 30 \
  --variants "tail torch,merged rows 8" --batches 1,16,32 --ctx 8192 --steps 16
