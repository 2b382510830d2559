#!/usr/bin/env bash
# The TRL venv (.venv-trl) of the peer benchmark (benchmarks/peers/setup_trl.sh does the work), so
# that CI runs the benchmark's 10-step smoke (tests/benchmarks/test_peer_trl.py).
# Measured on a 2-core machine: 9 s and 28 s (the download dominating), 107 MB on disk; a second run
# returns at once (the stamp file). Set MEGARL_SKIP_TRL_SETUP=1 to skip it (the smoke then skips,
# saying why); `make setup-trl` or running this file directly installs it as well.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [ "${MEGARL_SKIP_TRL_SETUP:-0}" = "1" ]; then echo "trl setup skipped (MEGARL_SKIP_TRL_SETUP=1)"; exit 0; fi
bash "$root/benchmarks/peers/setup_trl.sh"
