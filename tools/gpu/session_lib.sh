# Sourced by the per-session device scripts (tools/gpu/session4.sh, session5.sh): the environment of a
# device call, and `run NAME SECONDS CMD...` (log to $OUT/NAME.log, print its tail) / `left` (seconds left
# of the call's BUDGET, 570 by default).
export PYTHONPATH=. PYTHONUNBUFFERED=1 DS4_SHARED=$PWD/.gpu/shared DS4_TEST_CACHE=/tmp/ds4-cache
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $((${BUDGET:-570} - $(date +%s) + T0)); }
run() {
  local name=$1 secs=$2
  shift 2
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name (rc $?, $(( $(date +%s) - T0 )) s into the call)"
  grep -v -i "warn" "$OUT/$name.log" | tail -n "${TAIL:-14}"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
