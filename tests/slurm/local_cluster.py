"""A local two-or-more-node Slurm cluster on one machine for trying the sbatch templates: the test
fixture's cluster (tests/slurm/cluster.py: munged, slurmctld, one slurmd per emulated node in its own
network namespace), started in the foreground until Ctrl-C.

    sudo .venv/bin/python -m tests.slurm.local_cluster up --nodes 2
    # in another shell:
    source /tmp/megarl-local-slurm/env.sh && sinfo

Needs root (network namespaces, daemons as root) and Slurm + munge (``bash tests/setup/30-slurm.sh``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from tests.slurm.cluster import NETNS_BINARIES, SLURM_BINARIES, SlurmCluster, missing_binaries


def write_env(cluster: SlurmCluster, path: Path) -> None:
    """``path``: the exports a shell needs to use the cluster (SLURM_CONF, PATH with sbin)."""
    conf = cluster.env["SLURM_CONF"]
    path.write_text(f'export SLURM_CONF={conf}\nexport PATH="$PATH:/usr/sbin:/sbin"\n')


def up(nodes: int, state_dir: Path) -> int:
    """Start the cluster, print how to use it, keep it running until SIGINT/SIGTERM, then stop it."""
    missing = missing_binaries(SLURM_BINARIES + NETNS_BINARIES)
    if missing:
        print(f"local_cluster: missing {', '.join(missing)}: run `bash tests/setup/30-slurm.sh` as root")
        return 2
    if os.geteuid() != 0:
        print("local_cluster: run as root (slurmctld/slurmd run as root; nodes are network namespaces)")
        return 2
    closed = [p for p in state_dir.resolve().parents if p.exists() and not os.stat(p).st_mode & 0o001]
    if closed:
        print(
            f"local_cluster: --state-dir {state_dir}: munged needs o+x on every directory above it "
            f"({closed[0]} has none)"
        )
        return 2
    stop = []
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda *_: stop.append(1))
    state_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    cluster = SlurmCluster(state_dir, n_nodes=nodes)
    try:
        cluster.start()
        env_file = state_dir / "env.sh"
        write_env(cluster, env_file)
        if cluster.fallback_reason:
            print(f"local_cluster: FELL BACK TO ONE NODE: {cluster.fallback_reason}")
        print(
            f"local_cluster: {len(cluster.node_names)} node(s) {','.join(cluster.node_names)} idle after "
            f"{time.monotonic() - t0:.1f}s; logs in {state_dir}/log\n"
            f"  in another shell: source {env_file} && sinfo\n"
            "  Ctrl-C (or kill -TERM this process) stops the cluster",
            flush=True,
        )
        while not stop:
            time.sleep(0.5)
    finally:
        print("local_cluster: stopping", flush=True)
        cluster.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``up [--nodes N] [--state-dir DIR]``; returns the exit code."""
    ap = argparse.ArgumentParser(
        prog="python -m tests.slurm.local_cluster", description=__doc__.split("\n\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start the cluster in the foreground (Ctrl-C stops it)")
    u.add_argument("--nodes", type=int, default=2, help="emulated nodes node1..nodeN (default 2)")
    u.add_argument("--state-dir", type=Path, default=Path("/tmp/megarl-local-slurm"))
    args = ap.parse_args(argv)
    return up(args.nodes, args.state_dir)


if __name__ == "__main__":
    sys.exit(main())
