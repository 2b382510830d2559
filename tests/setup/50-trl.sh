#!/usr/bin/env bash
# The TRL venv (.venv-trl) of the peer benchmark (benchmarks/peers/setup_trl.sh does the work), so
# that CI runs the benchmark's 10-step smoke (tests/benchmarks/test_peer_trl.py).
# Measured on the shared 2-core machine: 52 s wall / 16 CPU s in a fresh clone (load average 1.7-6.4),
# 42 s / 15 CPU s with pip's cache warm (the download and pip's resolver dominating), 107 MB on disk;
# a second run returns in 0.2-0.5 s (the stamp file). The smoke it enables took 37 s wall at load average
# 2.1-3.4, 69 s wall / 42 CPU s at 4.5-5.1. Set MEGARL_SKIP_TRL_SETUP=1 to skip this step (the smoke then skips,
# saying why); `make setup-trl` or running this file directly installs it as well.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [ "${MEGARL_SKIP_TRL_SETUP:-0}" = "1" ]; then echo "trl setup skipped (MEGARL_SKIP_TRL_SETUP=1)"; exit 0; fi
bash "$root/benchmarks/peers/setup_trl.sh"
