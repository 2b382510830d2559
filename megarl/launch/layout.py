"""Launch layout: how a job's nodes split into a learner group and a rollout group, and the fail-fast check
that the node and GPU counts fit the learner's parallel layout (TP x PP x CP x DP, with EP inside)."""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """The allocation does not fit the configured layout; the message says which numbers disagree."""


@dataclass(frozen=True)
class Layout:
    """Parallel layout and node split of one job.

    learner_nodes / rollout_nodes: node counts of the two groups (split mode); with ``colocate`` every node
    runs learner ranks and rollout servers and ``rollout_nodes`` must be 0.
    procs_per_node: learner ranks per learner node (one per GPU on GPU clusters).
    gpus_per_node: GPUs per node (0 = CPU job).
    tp, pp, cp, ep, etp: tensor / pipeline / context / expert / expert-tensor parallel sizes of the learner.
    servers_per_node, gpus_per_server: rollout servers per rollout node and GPUs each (vLLM/SGLang TP size).
    """

    learner_nodes: int
    rollout_nodes: int = 0
    colocate: bool = False
    procs_per_node: int = 1
    gpus_per_node: int = 0
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    servers_per_node: int = 1
    gpus_per_server: int = 0

    @property
    def n_nodes(self) -> int:
        return self.learner_nodes + self.rollout_nodes

    @property
    def world_size(self) -> int:
        return self.learner_nodes * self.procs_per_node

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def has_rollout(self) -> bool:
        return self.colocate or self.rollout_nodes > 0

    @property
    def n_servers(self) -> int:
        nodes = self.learner_nodes if self.colocate else self.rollout_nodes
        return nodes * self.servers_per_node if self.has_rollout else 0

    def describe(self) -> str:
        """One line for logs: node split, world size and parallel sizes."""
        split = (
            f"{self.learner_nodes} colocated node(s)"
            if self.colocate
            else f"{self.learner_nodes} learner node(s) + {self.rollout_nodes} rollout node(s)"
        )
        return (
            f"{split}; world={self.world_size} ({self.procs_per_node}/node) tp={self.tp} pp={self.pp} "
            f"cp={self.cp} dp={self.dp} ep={self.ep} etp={self.etp}; rollout servers={self.n_servers}"
        )


def check_layout(layout: Layout, allocated_nodes: int | None = None, visible_gpus: int | None = None) -> None:
    """Raise LayoutError unless the layout is consistent and fits the allocation.

    allocated_nodes: nodes Slurm gave the step (None: not checked); visible_gpus: GPUs this node sees (None:
    unknown).
    """
    L = layout
    errors: list[str] = []
    for name in ("learner_nodes", "procs_per_node", "tp", "pp", "cp", "ep", "etp", "servers_per_node"):
        if getattr(L, name) < 1:
            errors.append(f"{name}={getattr(L, name)} must be >= 1")
    for name in ("rollout_nodes", "gpus_per_node", "gpus_per_server"):
        if getattr(L, name) < 0:
            errors.append(f"{name}={getattr(L, name)} must be >= 0")
    if L.learner_nodes < 1 and allocated_nodes is not None:
        errors.append(
            f"the job step has {allocated_nodes} node(s) and rollout_nodes={L.rollout_nodes}: no node is "
            f"left for the learner"
        )
    if errors:
        raise LayoutError("; ".join(errors))
    if L.colocate and L.rollout_nodes:
        errors.append(
            f"colocate=True runs rollout servers on the learner nodes, so rollout_nodes must be 0 "
            f"(got {L.rollout_nodes})"
        )
    if allocated_nodes is not None and allocated_nodes != L.n_nodes:
        errors.append(
            f"the job step has {allocated_nodes} node(s) but the layout needs {L.n_nodes} "
            f"(learner_nodes={L.learner_nodes} + rollout_nodes={L.rollout_nodes}); "
            f"fix #SBATCH --nodes or the node counts"
        )
    model_parallel = L.tp * L.pp * L.cp
    if L.world_size % model_parallel:
        errors.append(
            f"learner world size {L.world_size} (learner_nodes={L.learner_nodes} x "
            f"procs_per_node={L.procs_per_node}) is not divisible by tp*pp*cp={L.tp}*{L.pp}*{L.cp}"
            f"={model_parallel}"
        )
    if L.tp > L.procs_per_node or L.procs_per_node % L.tp:
        errors.append(
            f"tp={L.tp} must divide procs_per_node={L.procs_per_node} so a tensor-parallel group "
            f"stays inside one node"
        )
    if not L.world_size % model_parallel and (L.world_size // L.pp) % (L.ep * L.etp):
        errors.append(f"ep*etp={L.ep}*{L.etp} must divide world_size/pp={L.world_size // L.pp}")
    if L.gpus_per_node:
        if L.procs_per_node > L.gpus_per_node:
            errors.append(
                f"procs_per_node={L.procs_per_node} learner ranks need more GPUs than "
                f"gpus_per_node={L.gpus_per_node}"
            )
        if L.has_rollout and L.servers_per_node * max(L.gpus_per_server, 1) > L.gpus_per_node:
            errors.append(
                f"servers_per_node={L.servers_per_node} x gpus_per_server={L.gpus_per_server} exceeds "
                f"gpus_per_node={L.gpus_per_node}"
            )
        if visible_gpus is not None and visible_gpus < L.gpus_per_node:
            errors.append(
                f"this node sees {visible_gpus} GPU(s) (SLURM_GPUS_ON_NODE / CUDA_VISIBLE_DEVICES) but "
                f"gpus_per_node={L.gpus_per_node}; request them with #SBATCH --gpus-per-node"
            )
    elif L.gpus_per_server:
        errors.append(f"gpus_per_server={L.gpus_per_server} but gpus_per_node=0 (CPU job)")
    if errors:
        raise LayoutError("; ".join(errors))
