#!/usr/bin/env bash
# Run the SGLang client tests against a REAL SGLang server on a GPU machine (with network to PyPI).
# On CPU the same tests run against the venv of tests/setup/40-sglang.sh; this script installs the
# CUDA build instead (into SGLANG_VENV, default .venv-sglang-gpu) and runs them with --device cuda.
#
#   bash tests/rollout/gpu_sglang.sh            # installs sglang==0.5.23 into .venv-sglang-gpu if missing
#   SGLANG_VERSION=0.5.24 bash tests/rollout/gpu_sglang.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
venv="${SGLANG_VENV:-$root/.venv-sglang-gpu}"
version="${SGLANG_VERSION:-0.5.23}"
command -v nvidia-smi >/dev/null && nvidia-smi -L || { echo "no NVIDIA GPU visible" >&2; exit 2; }
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import sglang" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q "sglang[all]==$version"
fi
"$venv/bin/python" -c "import sglang; print('sglang', sglang.__version__)"
[ -x .venv/bin/python ] || bash tests/setup/10-python.sh
export MEGARL_SGLANG_PYTHON="$venv/bin/python" MEGARL_SGLANG_DEVICE=cuda MEGARL_REQUIRE_SGLANG=1
# The live tests plus the replay tests (the same client, the recorded contract).
.venv/bin/python -m pytest -q tests/rollout/test_sglang_live.py tests/rollout/test_sglang_replay.py "$@"
