"""What a launcher task learns from the Slurm environment of its ``srun`` step."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from megarl.launch.hostlist import expand_hostlist


class SlurmEnvError(RuntimeError):
    """A required SLURM_* variable is missing or malformed."""


@dataclass(frozen=True)
class SlurmTask:
    """One launcher task of a Slurm job step (the launcher runs as one task per node).

    nodes: host names of the step in Slurm order; node_id: index of this task's node in ``nodes``.
    """

    job_id: str
    nodes: tuple[str, ...]
    node_id: int
    proc_id: int
    n_tasks: int
    hostname: str
    restart_count: int
    gpus_on_node: int | None

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    @property
    def node_name(self) -> str:
        return self.nodes[self.node_id]


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        if default is None:
            raise SlurmEnvError(f"{key} is not set: run the launcher inside a Slurm job step (srun)")
        return default
    try:
        return int(raw.split("(")[0])
    except ValueError:
        raise SlurmEnvError(f"{key}={raw!r} is not an integer") from None


def _visible_gpus(env: Mapping[str, str]) -> int | None:
    if env.get("SLURM_GPUS_ON_NODE"):
        return _int(env, "SLURM_GPUS_ON_NODE")
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return len([d for d in cvd.split(",") if d.strip() not in ("", "-1", "NoDevFiles")])
    return None


def read_slurm_task(env: Mapping[str, str] | None = None) -> SlurmTask:
    """Parse SLURM_JOB_ID, SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST), SLURM_NODEID, SLURM_PROCID,
    SLURM_NTASKS."""
    env = os.environ if env is None else env
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise SlurmEnvError("SLURM_JOB_NODELIST is not set: run the launcher inside a Slurm job step (srun)")
    nodes = tuple(expand_hostlist(nodelist))
    node_id = _int(env, "SLURM_NODEID")
    if not 0 <= node_id < len(nodes):
        raise SlurmEnvError(f"SLURM_NODEID={node_id} outside the node list {nodelist!r} ({len(nodes)} nodes)")
    return SlurmTask(
        job_id=env.get("SLURM_JOB_ID", "0"),
        nodes=nodes,
        node_id=node_id,
        proc_id=_int(env, "SLURM_PROCID", 0),
        n_tasks=_int(env, "SLURM_NTASKS", len(nodes)),
        hostname=env.get("SLURMD_NODENAME") or socket.gethostname(),
        restart_count=_int(env, "SLURM_RESTART_COUNT", 0),
        gpus_on_node=_visible_gpus(env),
    )
