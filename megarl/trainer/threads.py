"""How many torch threads a ``megarl train`` process uses.

``MEGARL_NUM_THREADS`` when set; else the cores this process may run on divided by the processes
torchrun started on this node (``LOCAL_WORLD_SIZE``; 1 without torchrun), at least 1. torch's own
default (one thread per core in every process, or 1 under torchrun, which sets ``OMP_NUM_THREADS=1``)
oversubscribes the cores in the first case and leaves them idle in the second.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ENV_VAR = "MEGARL_NUM_THREADS"

# The environment-variable section of docs/configuration.md (megarl.trainer.config_docs renders it).
ENV_DOC = [
    "## Environment variables",
    "",
    "| variable | default | meaning |",
    "|---|---|---|",
    f"| `{ENV_VAR}` | cores / local ranks | torch threads of each `megarl train` process "
    "(`torch.set_num_threads`, called before anything is built). Unset: the cores the process may run on "
    "(its CPU affinity) divided by the processes torchrun started on the node (`LOCAL_WORLD_SIZE`, 1 "
    "without torchrun), at least 1; so one process on 2 cores gets 2, `torchrun --nproc-per-node 2` "
    "gives each rank 1. A positive integer; anything else stops the run with a message naming the "
    "variable. The thread count changes the order of float sums: a run is reproducible at a fixed seed "
    "for a fixed thread count (the tests use 1). |",
    "",
]


class ThreadsError(ValueError):
    """``MEGARL_NUM_THREADS`` is not a positive integer."""


def available_cores() -> int:
    """The CPUs this process may run on (its affinity mask; all CPUs where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API on this platform
        return os.cpu_count() or 1


def torch_threads(env: Mapping[str, str], cores: int) -> int:
    """The thread count for ``env`` on ``cores`` cores (see the module docstring)."""
    raw = env.get(ENV_VAR, "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise ThreadsError(f"{ENV_VAR}={raw!r}: give a positive integer (torch threads per process)")
        return n
    local = env.get("LOCAL_WORLD_SIZE", "").strip()
    ranks = int(local) if local.isdigit() and int(local) > 0 else 1
    return max(1, cores // ranks)


def set_torch_threads(env: Mapping[str, str] | None = None) -> int:
    """Set torch's intra-op thread count for this process from ``env`` (default ``os.environ``);
    returns it."""
    import torch

    n = torch_threads(os.environ if env is None else env, available_cores())
    torch.set_num_threads(n)
    return n
