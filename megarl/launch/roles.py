"""Role of each node of a job and the torch.distributed environment of each learner rank."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from megarl.launch.layout import Layout, LayoutError


class Role(enum.Enum):
    LEARNER = "learner"
    ROLLOUT = "rollout"
    COLOCATED = "colocated"  # learner ranks and rollout servers on the same node


@dataclass(frozen=True)
class NodePlan:
    """What one node runs.

    node_rank: index inside the learner group (None on rollout-only nodes);
    rollout_index: index inside the rollout group (None on learner-only nodes);
    first_rank: global learner rank of this node's local rank 0.
    """

    node: str
    role: Role
    node_rank: int | None
    rollout_index: int | None
    first_rank: int | None

    @property
    def runs_learner(self) -> bool:
        return self.role in (Role.LEARNER, Role.COLOCATED)

    @property
    def runs_rollout(self) -> bool:
        return self.role in (Role.ROLLOUT, Role.COLOCATED)


def assign_roles(nodes: list[str] | tuple[str, ...], layout: Layout) -> list[NodePlan]:
    """Split ``nodes`` (Slurm order) into the learner group (first ``learner_nodes``) and the rollout group
    (rest)."""
    if len(nodes) != layout.n_nodes:
        raise LayoutError(f"{len(nodes)} node(s) {list(nodes)} but the layout needs {layout.n_nodes}")
    if len(set(nodes)) != len(nodes):
        raise LayoutError(f"duplicate node names in {list(nodes)}: run one launcher task per node")
    plans = []
    for i, node in enumerate(nodes):
        if layout.colocate:
            plans.append(NodePlan(node, Role.COLOCATED, i, i, i * layout.procs_per_node))
        elif i < layout.learner_nodes:
            plans.append(NodePlan(node, Role.LEARNER, i, None, i * layout.procs_per_node))
        else:
            plans.append(NodePlan(node, Role.ROLLOUT, None, i - layout.learner_nodes, None))
    return plans


def master_addr(plans: list[NodePlan]) -> str:
    """Host of learner rank 0 (the torch.distributed TCP store)."""
    return next(p.node for p in plans if p.runs_learner)


def default_master_port(job_id: str, base: int = 20000, span: int = 10000) -> int:
    """A port derived from the job id, so two jobs sharing a node do not both pick 29500."""
    digits = "".join(ch for ch in job_id if ch.isdigit()) or "0"
    return base + int(digits) % span


def learner_rank_env(plan: NodePlan, local_rank: int, layout: Layout, addr: str, port: int) -> dict[str, str]:
    """torch.distributed variables (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK, ...) plus the layout
    sizes."""
    if not plan.runs_learner or plan.first_rank is None or plan.node_rank is None:
        raise ValueError(f"node {plan.node} has role {plan.role.value}: no learner ranks")
    if not 0 <= local_rank < layout.procs_per_node:
        raise ValueError(f"local_rank={local_rank} outside procs_per_node={layout.procs_per_node}")
    return {
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "RANK": str(plan.first_rank + local_rank),
        "WORLD_SIZE": str(layout.world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(layout.procs_per_node),
        "NODE_RANK": str(plan.node_rank),
        "GROUP_RANK": str(plan.node_rank),
        "MEGARL_TP": str(layout.tp),
        "MEGARL_PP": str(layout.pp),
        "MEGARL_CP": str(layout.cp),
        "MEGARL_EP": str(layout.ep),
        "MEGARL_ETP": str(layout.etp),
        "MEGARL_DP": str(layout.dp),
    }
