#!/usr/bin/env bash
# The project venv (.venv): CPU torch first, then megarl with its test and HF extras.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${VENV:-$root/.venv}"
stamp="$venv/.megarl-setup"
if [ -f "$stamp" ] && [ "$stamp" -nt "$root/pyproject.toml" ]; then exit 0; fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q -e "$root[test,hf]"
"$venv/bin/python" -c "import torch, megatron.core, hypothesis; print('torch', torch.__version__)"
touch "$stamp"
