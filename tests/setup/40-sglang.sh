#!/usr/bin/env bash
# The SGLang venv: SGLang 0.5.23 on a CPU-only machine, in its own venv (it pins its own transformers),
# reached through the link .venv-sglang at the repository root. Its wheel pins CUDA packages (torch,
# flashinfer, sgl-kernel, cuda-python) and has no CPU extra, so: CPU torch, sglang --no-deps, then
# the dependencies its CPU engine imports (sglang_cpu/requirements.txt), with uv. Two fixes live in
# sglang_cpu/: an import-time stub for the CUDA-only sgl_kernel package (copied into the venv) and
# a patch that lets the registry's CUDA-built torchvision import on torch+cpu.
#
# The venv lives outside the checkout, in $MEGARL_CACHE_DIR (default ~/.cache/megarl), in a folder
# named by a checksum of the pins and of the files in sglang_cpu/, so a fresh clone on the same
# machine reuses it (0.01-0.04 s) and a change of pins builds a new one. SGLANG_VENV=DIR puts it at DIR.
# Measured on 2 cores with nothing cached: 61 s wall, 55 s CPU (half of it compiling bytecode), 1.8 GB
# in uv's cache hard-linked into the venv plus 0.4 GB of its own (docs/rollout.md "SGLang on CPU").
# torch is not a second copy: its files are hard links to the project venv's CPU torch 2.13.0
# (same files, same inodes; pip installs it when .venv has another torch or lies on another file
# system). Part of `make setup`; MEGARL_SKIP_SGLANG_SETUP=1 skips it (the live SGLang tests then
# skip, and fail under CI=true unless that variable is set there too).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
here="$root/tests/setup/sglang_cpu"
if [ "${MEGARL_SKIP_SGLANG_SETUP:-0}" = "1" ]; then
  echo "sglang setup skipped (MEGARL_SKIP_SGLANG_SETUP=1)"; exit 0
fi
recipe=3  # raise when the steps below change in a way the pins and sglang_cpu/ files do not show
pins="sglang==0.5.23 torch==2.13.0 torchvision==0.28.0 timm==1.0.25 soundfile==0.13.1 uv==0.13.8"
files="$(cat "$here/requirements.txt" "$here/sgl_kernel/__init__.py" "$here/patch_torchvision.py" | cksum | cut -d' ' -f1)"
version="recipe=$recipe $pins files=$files"
cache="${MEGARL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/megarl}"
venv="${SGLANG_VENV:-$cache/sglang-0.5.23-$(echo "$version" | cksum | cut -d' ' -f1)}"
link="$root/.venv-sglang"
stamp="$venv/.megarl-sglang-setup"

link_venv() {  # .venv-sglang -> the venv (an older venv made in the checkout itself is removed)
  if [ "$venv" = "$link" ] || [ "$venv" -ef "$link" ]; then return 0; fi
  if [ -L "$link" ]; then
    rm "$link"
  elif [ -f "$link/pyvenv.cfg" ]; then
    rm -rf "$link"
  elif [ -e "$link" ]; then
    echo "40-sglang.sh: $link exists and is not a venv; move it away" >&2; exit 1
  fi
  ln -s "$venv" "$link"
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$version" ]; then link_venv; exit 0; fi
if [ -e "$venv" ]; then  # unfinished or older: start again
  [ -f "$venv/pyvenv.cfg" ] || { echo "40-sglang.sh: $venv exists and is not a venv" >&2; exit 1; }
  rm -rf "$venv"
fi
echo "sglang setup: building $venv"
mkdir -p "$(dirname "$venv")"
python3 -m venv "$venv"
py="$venv/bin/python"
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$venv/bin/pip" install -q uv==0.13.8
uv=("$venv/bin/uv" pip install -q --python "$py")

torch_dirs=(torch torchgen functorch torch-2.13.0+cpu.dist-info)
main_site="$("$root/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)"
if [ -n "$main_site" ] && [ "${main_site##*/lib/}" = "${site##*/lib/}" ] \
  && [ -d "$main_site/torch-2.13.0+cpu.dist-info" ] \
  && (cd "$main_site" && cp -al "${torch_dirs[@]}" "$site/") 2>/dev/null; then
  echo "sglang setup: torch 2.13.0+cpu hard-linked from $main_site"
else
  (cd "$site" && rm -rf "${torch_dirs[@]}")
  "$venv/bin/pip" install -q torch==2.13.0  # pip: the machine's pip configuration picks the CPU build
fi

"${uv[@]}" --no-deps sglang==0.5.23
"${uv[@]}" torch==2.13.0 -r "$here/requirements.txt"
"${uv[@]}" --no-deps soundfile==0.13.1 timm==1.0.25 torchvision==0.28.0
"$py" "$here/patch_torchvision.py" "$site"
rm -rf "$site/sgl_kernel"
cp -r "$here/sgl_kernel" "$site/sgl_kernel"
# uv writes no .pyc files, and with PYTHONDONTWRITEBYTECODE=1 the server's three processes would
# compile SGLang and transformers at every start (about 6 s CPU each); a few test files of torch and
# others do not compile on Python 3.11, hence `|| true`
"$py" -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
SGLANG_USE_CPU_ENGINE=1 "$py" -c \
  "import sglang, torch, sgl_kernel; print('sglang', sglang.__version__, 'torch', torch.__version__)"
echo "$version" > "$stamp"
link_venv
