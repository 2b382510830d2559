#!/usr/bin/env bash
# Runs every tests/setup/NN-*.sh in order. Each step is idempotent and installs only from
# public registries by package name (torch==2.13.0 first, so nothing pulls a CUDA build).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
for step in "$here"/[0-9][0-9]-*.sh; do
  echo "== setup: $(basename "$step")"
  bash "$step"
done
