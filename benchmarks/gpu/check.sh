#!/usr/bin/env bash
# The prepared GPU check (docs/gpu.md): one script, a few minutes on one H100/H200-class GPU.
#   bash benchmarks/gpu/check.sh                  # run the checks; skipped (exit 0) without a GPU
#   MEGARL_GPU_SETUP=1 bash benchmarks/gpu/check.sh   # first make .venv-gpu (torch CUDA + megarl[gpu])
#                                                     # and .venv-vllm (vLLM), with network access
# Arguments go to benchmarks/gpu/check.py (--skip parity,step,sync,grpo; --step-tokens N; --device cpu).
# Python: MEGARL_GPU_PYTHON, else .venv-gpu/bin/python, else .venv/bin/python.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
cpu=0
for a in "$@"; do [ "$a" = "cpu" ] && cpu=1; done
if [ "$cpu" = 0 ] && ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  echo "benchmarks/gpu/check.sh: skipped: no NVIDIA GPU here (nvidia-smi finds none)"
  exit 0
fi
if [ "${MEGARL_GPU_SETUP:-0}" = "1" ]; then
  [ -x .venv-gpu/bin/python ] || python3 -m venv .venv-gpu
  .venv-gpu/bin/pip install -q --upgrade pip
  .venv-gpu/bin/pip install -q -e ".[gpu]"
  [ -x .venv-vllm/bin/python ] || python3 -m venv .venv-vllm
  .venv-vllm/bin/pip install -q vllm
fi
py="${MEGARL_GPU_PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv-gpu/bin/python ]; then py=.venv-gpu/bin/python; else py=.venv/bin/python; fi
fi
# the whole check is meant to end well inside 8 minutes
exec timeout "${MEGARL_GPU_CHECK_TIMEOUT:-480}" "$py" benchmarks/gpu/check.py "$@"
