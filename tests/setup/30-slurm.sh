#!/usr/bin/env bash
# Real Slurm for tests/slurm: Debian's slurm-wlm + munge, and iproute2 for the two-node
# network-namespace fixture. Idempotent: installs only what is missing. Needs root (CI runs setup as root).
set -euo pipefail
need=()
command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 && command -v sbatch >/dev/null 2>&1 || need+=(slurm-wlm)
command -v munged >/dev/null 2>&1 && command -v mungekey >/dev/null 2>&1 || need+=(munge)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v nsenter >/dev/null 2>&1 && command -v unshare >/dev/null 2>&1 || need+=(util-linux)
if [ "${#need[@]}" -eq 0 ]; then
  echo "slurm: already installed ($(slurmctld -V 2>/dev/null || echo '?'))"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "slurm: missing ${need[*]}; run this script as root to install them" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# Debian's postinst may start daemons where an init system exists; the tests run their own.
echo "slurm: installed ${need[*]} ($(slurmctld -V))"
