#!/bin/bash
# Device calls of session 13, one part per call (.gpu/shared carried, see session5.sh):
#   part a: where a B = 32 step goes now (profile_batch.py without PDL, 8k ctx), and session 12's best
#           integer Q8_0 variant (4 rows x 1024) on the whole model at 4k ctx.
# Usage: bash tools/gpu/session13.sh a
source "$(dirname "$0")/session_lib.sh"
if [ "$1" = a ]; then
  TAIL=34 run profile32 200 env DS4_PDL=0 python3 tools/gpu/profile_batch.py 32 8192
  TAIL=8 run ab "$(left)" python3 tools/gpu/ab_decode.py --rounds 2 --variants "q8 int8 bn4"
fi
