#!/usr/bin/env bash
# The TRL venv (.venv-trl) of the peer benchmark (benchmarks/peers/compare_trl.py, docs/benchmarks.md):
# trl 1.16.0 with accelerate 1.15.0 and datasets 5.2.0. torch, transformers and the rest of what they
# share with megarl come from the project venv (.venv, made first by tests/setup/10-python.sh) through
# a .pth file, so both sides run the same torch 2.13.0 and transformers builds and only TRL's own
# packages are downloaded (107 MB on disk). Override the location with TRL_VENV.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${TRL_VENV:-$root/.venv-trl}"
base="${VENV:-$root/.venv}"
stamp="$venv/.megarl-trl-setup"
if [ ! -x "$base/bin/python" ]; then
  echo "setup_trl.sh: no project venv at $base (make setup-python creates it first)" >&2; exit 1
fi
pins="trl==1.16.0 accelerate==1.15.0 datasets==5.2.0"
base_site="$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$pins $base_site" ]; then exit 0; fi
[ -x "$venv/bin/python" ] || "$base/bin/python" -m venv --without-pip "$venv"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$base_site" > "$site/megarl-base-venv.pth"
# pip of the project venv installs into this venv (--python); no second pip is downloaded
"$base/bin/python" -m pip --python "$venv/bin/python" install -q $pins
"$venv/bin/python" -c "import trl, transformers, torch; print('trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
echo "$pins $base_site" > "$stamp"
