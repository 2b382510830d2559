#!/usr/bin/env bash
# The TRL venv (.venv-trl) of the peer benchmark (benchmarks/peers/setup_trl.sh does the work).
# Opt-in: `make setup` (tests/setup/all.sh) runs it only with MEGARL_WITH_TRL=1, because with the
# venv the benchmark's smoke test runs (tests/benchmarks/test_peer_trl.py: 230 s measured on the
# shared 2-core machine), more than CI's budget allows; without it that test skips, saying why.
# `make setup-trl` or running this file directly always installs.
# Measured on a 2-core machine: 9 s and 28 s (the download dominating), 107 MB on disk.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [ "${MEGARL_SETUP_ALL:-0}" = "1" ] && [ "${MEGARL_WITH_TRL:-0}" != "1" ]; then
  echo "trl setup skipped (opt-in: MEGARL_WITH_TRL=1 make setup, or make setup-trl)"; exit 0
fi
bash "$root/benchmarks/peers/setup_trl.sh"
