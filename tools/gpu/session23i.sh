#!/bin/bash
# Session 23's second H100 call, after the switch to the fused tail and merged rows 64 as defaults: the
# batched-vs-alone check at the new defaults (4-layer Flash width), the merged-rows and tail GPU tests, then
# the steps with the old settings as variants on the first 30 layers (3 rounds).
# Usage: bash tools/gpu/session23i.sh
source "$(dirname "$0")/session_lib.sh"
TAIL=3 run tests 100 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_cuda_batch.py \
  tests/test_cuda_backend.py -k "merged or tail or official"
TAIL=8 run check 110 python3 tools/gpu/batch_check.py --skip-time
TAIL=12 run steps "$(left)" python3 tools/gpu/batch_check.py --skip-check --layers 30 \
  --variants "tail torch,merged rows 8" --batches 1,32 --ctx 8192 --steps 16 --rounds 3
