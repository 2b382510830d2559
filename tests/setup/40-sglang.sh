#!/usr/bin/env bash
# The SGLang venv (.venv-sglang): SGLang 0.5.23 on a CPU-only machine, in its own venv (it pins its own
# transformers). Its wheel pins CUDA packages (torch, flashinfer, sgl-kernel, cuda-python) and has no CPU
# extra, so: CPU torch first, sglang --no-deps, then the CPU-safe part of its dependencies. Two fixes live
# next to this script in sglang_cpu/: an import-time stub for the CUDA-only sgl_kernel package (copied
# into the venv's site-packages) and a patch that lets the registry's CUDA-built torchvision import on
# torch+cpu. Override the location with SGLANG_VENV (e.g. a cache outside the checkout).
# Opt-in: measured 7-8 minutes and 3.2 GB on a 2-core machine, so `make setup` (tests/setup/all.sh)
# runs it only with MEGARL_WITH_SGLANG=1; `make setup-sglang` or running this file directly always
# installs. Without the venv the live SGLang tests skip, loudly.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
here="$root/tests/setup/sglang_cpu"
venv="${SGLANG_VENV:-$root/.venv-sglang}"
stamp="$venv/.megarl-sglang-setup"
version="sglang==0.5.23 torch==2.13.0 stub=$(cksum < "$here/sgl_kernel/__init__.py" | cut -d' ' -f1)"
if [ "${MEGARL_SETUP_ALL:-0}" = "1" ] && [ "${MEGARL_WITH_SGLANG:-0}" != "1" ]; then
  echo "sglang setup skipped (opt-in: MEGARL_WITH_SGLANG=1 make setup, or make setup-sglang)"; exit 0
fi
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$version" ]; then exit 0; fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip="$venv/bin/pip"
"$pip" install -q --upgrade pip
"$pip" install -q torch==2.13.0
"$pip" install -q --no-deps sglang==0.5.23
"$pip" install -q torch==2.13.0 "transformers==5.19.0" "tokenizers==0.23.2" aiohttp anthropic blobfile==3.0.0 \
  build "compressed-tensors==0.18.0" datasets distro easydict einops fastapi gguf interegular IPython \
  "llguidance>=1.7.6,<2.0.0" "mistral_common>=1.11.5" msgspec ninja numpy "openai==2.8.0" \
  "openai-harmony==0.0.4" orjson packaging partial_json_parser pillow "prometheus-client>=0.20.0" psutil \
  pybase64 pydantic "python-dateutil<3" python-multipart "pyzmq>=25.1.2" regex requests scipy \
  "sentencepiece==0.2.1" setproctitle tiktoken tqdm "uvicorn>=0.51" uvloop watchfiles "xgrammar==0.2.7" \
  xxhash zstandard "numba==0.65.1" "apache-tvm-ffi==0.1.11" nvidia-ml-py smg-grpc-servicer cffi
"$pip" install -q --no-deps soundfile==0.13.1 timm==1.0.25 torchvision==0.28.0
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$venv/bin/python" "$here/patch_torchvision.py" "$site"
rm -rf "$site/sgl_kernel"
cp -r "$here/sgl_kernel" "$site/sgl_kernel"
SGLANG_USE_CPU_ENGINE=1 "$venv/bin/python" -c \
  "import sglang, torch, sgl_kernel; print('sglang', sglang.__version__, 'torch', torch.__version__)"
echo "$version" > "$stamp"
