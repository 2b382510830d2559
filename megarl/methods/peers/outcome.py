"""Outcome-reward advantage estimators of the peers' catalogue: OPO (length-weighted group
baseline) and GRPO pass@k (only each group's best response learns); formulas: reference/peers.py."""

from __future__ import annotations

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, per_token, scalar_rewards
from megarl.ops.segments import _dense_groups, group_std
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo


def opo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """R − Σ_g |y| R / Σ_g |y| (baseline 0 for a group of one or of empty responses); [B] -> [B]."""
    inv, n = _dense_groups(group_ids)
    w = lengths.to(rewards.dtype)
    num = torch.zeros(n, dtype=rewards.dtype).index_add(0, inv, w * rewards)
    den = torch.zeros(n, dtype=rewards.dtype).index_add(0, inv, w)
    size = torch.zeros(n, dtype=rewards.dtype).index_add(0, inv, torch.ones_like(rewards))
    base = torch.where((size > 1) & (den > 0), num / den.clamp(min=1), torch.zeros_like(num))
    return rewards - base[inv]


def grpo_passk_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """(r_max − r_second)[/(std_g + ε)] on each group's first best response, 0 elsewhere; [B] -> [B]."""
    inv, n = _dense_groups(group_ids)
    B = rewards.numel()
    size = torch.bincount(inv, minlength=n)
    if bool((size < 2).any()):
        g = int(torch.unique(group_ids)[int(torch.nonzero(size < 2)[0])])
        raise ValueError(
            f"advantage.estimator=grpo_passk needs at least 2 responses per group; group {g} has 1"
        )
    top = torch.full((n,), -torch.inf, dtype=rewards.dtype).scatter_reduce(0, inv, rewards, "amax")
    pos = torch.arange(B)
    at_top = torch.where(rewards == top[inv], pos, torch.full_like(pos, B))
    best = torch.full((n,), B, dtype=pos.dtype).scatter_reduce(0, inv, at_top, "amin")
    is_best = pos == best[inv]
    others = torch.where(is_best, torch.full_like(rewards, -torch.inf), rewards)
    second = torch.full((n,), -torch.inf, dtype=rewards.dtype).scatter_reduce(0, inv, others, "amax")
    a = (top - second)[inv]
    if scale_by_std:
        a = a / (group_std(rewards, group_ids) + eps)
    return torch.where(is_best, a, torch.zeros_like(a))


def _opo(batch) -> torch.Tensor:
    """OPO advantages on every loss token; the length is the response's loss-token count; [T]."""
    return per_token(batch, opo_advantages(scalar_rewards(batch), batch.group_ids, batch.response_lens()))


def _grpo_passk(batch, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO pass@k advantages on every loss token; [T]."""
    return per_token(batch, grpo_passk_advantages(scalar_rewards(batch), batch.group_ids, scale_by_std, eps))


ADVANTAGE_ESTIMATORS.add("opo", _opo)  # a group of one keeps its reward (baseline 0, as verl)
ADVANTAGE_ESTIMATORS.add("grpo_passk", _grpo_passk, PartInfo(group_relative=True))

OPO = MethodSpec(
    name="opo",
    summary="OPO: advantages against the length-weighted group mean reward",
    provenance="code",
    config={"advantage": {"estimator": "opo"}},
)
GRPO_PASSK = MethodSpec(
    name="grpo_passk",
    summary="GRPO pass@k: only each group's best response gets r_max - r_second",
    provenance="code",
    config={"advantage": {"estimator": "grpo_passk"}},
)
