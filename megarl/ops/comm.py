"""The collectives the ops use, behind one seam.

``group`` is a torch.distributed process group, ``None`` (no parallelism), or any object with the
``sim_all_reduce`` / ``sim_all_gather`` methods (megarl.testing.simulated_group: one process,
ranks as threads, used by the property tests). Real groups go straight to torch.distributed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _simulated(group: Any) -> bool:
    return hasattr(group, "sim_all_reduce")


def world_size(group: Any) -> int:
    """Number of ranks in ``group`` (1 for None)."""
    if group is None:
        return 1
    if _simulated(group):
        return group.size()
    return dist.get_world_size(group)


def rank(group: Any) -> int:
    """This rank's index in ``group`` (0 for None)."""
    if group is None:
        return 0
    if _simulated(group):
        return group.rank()
    return dist.get_rank(group)


def all_reduce(t: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """In-place all-reduce of ``t`` with op 'sum' | 'max' | 'min'; returns ``t``."""
    if world_size(group) == 1:
        return t
    if _simulated(group):
        return group.sim_all_reduce(t, op)
    dist.all_reduce(t, op=_OPS[op], group=group)
    return t


def all_gather(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Gather ``t`` (same shape on every rank) from all ranks, in rank order."""
    if world_size(group) == 1:
        return [t]
    if _simulated(group):
        return group.sim_all_gather(t)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out
