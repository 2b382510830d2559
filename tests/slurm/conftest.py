"""Session fixture: a real Slurm cluster (munged, slurmctld, one slurmd per emulated node) for tests marked
slurm."""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest

from tests.slurm.cluster import NETNS_BINARIES, SLURM_BINARIES, SlurmCluster, missing_binaries

N_NODES = 3  # 2 learner nodes (ranks span nodes) + 1 rollout node
_FALLBACK: list[str] = []


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _unavailable(reason: str) -> None:
    """In CI a missing Slurm is a failure, elsewhere a skip."""
    if in_ci():
        pytest.fail(
            f"{reason} (CI=true: the Slurm tests must run; see tests/setup/30-slurm.sh)", pytrace=False
        )
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running test cluster; node1..node3 in network namespaces, or one loopback node as a loud fallback."""
    missing = missing_binaries(SLURM_BINARIES + NETNS_BINARIES)
    if missing:
        _unavailable(
            f"Slurm not installed: missing {', '.join(missing)}; run `bash tests/setup/30-slurm.sh` as root"
        )
    if os.geteuid() != 0:
        _unavailable("the Slurm fixture runs slurmctld/slurmd as root; run the tests as root")
    state = Path(tempfile.mkdtemp(prefix="megarl-slurm-"))
    cluster = SlurmCluster(state, n_nodes=N_NODES)
    try:
        cluster.start()
    except Exception:
        cluster.stop()
        raise
    if cluster.fallback_reason:
        msg = f"SLURM FIXTURE FELL BACK TO ONE NODE: {cluster.fallback_reason}. Multi-node tests are skipped."
        _FALLBACK.append(msg)
        warnings.warn(msg, stacklevel=2)
        print(f"\n{'!' * 20} {msg} {'!' * 20}", flush=True)
    yield cluster
    cluster.stop()
    if not os.environ.get("MEGARL_KEEP_SLURM_STATE"):
        shutil.rmtree(state, ignore_errors=True)


def pytest_terminal_summary(terminalreporter) -> None:
    for msg in _FALLBACK:
        terminalreporter.write_sep("!", msg, red=True, bold=True)
