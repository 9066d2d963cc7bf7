#!/usr/bin/env bash
# The lent GPU machine's check, as that machine is: offline, its own Python and torch, nothing
# installed. The whole run is at most 535 s (the build bounded to 30 s, the Python part to its
# 490 s budget, killed at 505 s), under the device's 600 s a command; with about 1.5 min to start
# the machine, a rerun's start fits the 15-minute lease only if the first run fails early.
#   device run:  bash scripts/gpu_check.sh            (report and log under $OUT)
#   here (CPU):  bash scripts/gpu_check.sh --dry-run  (tiny sizes, float32; tests/test_gpu_check.py)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
LOG="$OUT/gpu_check.log"
{
  echo "[gpu_check] $(date -u +%FT%TZ) $($PY --version 2>&1); no install step (offline machine)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "[gpu_check] no nvidia-smi"
  # The compiled cores, built in place with the tools there (pybind11, a C++ compiler); the
  # Python ones are used when the build fails (env phase reports which).
  if timeout 30 $PY setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1; then
    echo "[gpu_check] compiled cores built"
  else
    echo "[gpu_check] compiled cores not built (see build.log): the Python ones are used"
  fi
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 timeout 505 $PY scripts/gpu_check.py "$OUT" "$@"
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
