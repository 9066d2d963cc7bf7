#!/usr/bin/env bash
# On a machine with one GPU (about 8 minutes): the native engine on CUDA (HF parity, greedy
# identity with HistoSpec), then HistoSpec inside vLLM in bf16 (greedy identity, the T=1
# two-sample test, one timing row). Writes a JSON report: gpu_check.json, or $OUT/gpu_check.json.
set -uo pipefail
cd "$(dirname "$0")/.."
REPORT="${OUT:-.}/gpu_check.json"
PY=python3
# rhymerl itself: installed with the [vllm] extra where the index is reachable; offline, from
# the source tree (the compiled suffix core is built in place, or the Python one is used).
if timeout 300 $PY -m pip install -q -e ".[vllm]" >/tmp/gpu_check_pip.log 2>&1; then
  echo "installed .[vllm]"
else
  echo "pip install -e .[vllm] failed (offline?): running from the source tree; see /tmp/gpu_check_pip.log"
  timeout 120 $PY setup.py build_ext --inplace >/tmp/gpu_check_build.log 2>&1 || echo "suffix core not built: the Python one is used"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 420 $PY scripts/gpu_check.py "$REPORT"
