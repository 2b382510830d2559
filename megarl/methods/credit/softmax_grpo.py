"""SoftmaxGRPO: temperature-scaled softmax advantages inside each group (formula: reference/credit.py)."""

from __future__ import annotations

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, per_token, scalar_rewards
from megarl.ops.segments import _dense_groups, group_all_equal
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo


def softmax_grpo(rewards: torch.Tensor, group_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """A_i = G·softmax_g(R/τ)_i − 1, exactly 0 for a group of equal rewards; [B] -> [B].

    The softmax is shifted by the group max, so any τ > 0 is finite (τ → 0 is the MaxRL limit).
    """
    if not temperature > 0:
        raise ValueError(f"softmax_grpo: temperature={temperature!r} must be > 0")
    inv, n = _dense_groups(group_ids)
    z = rewards / temperature
    zmax = torch.full((n,), -torch.inf, dtype=z.dtype).scatter_reduce(0, inv, z, "amax")
    e = torch.exp(z - zmax[inv])
    denom = torch.zeros(n, dtype=z.dtype).index_add(0, inv, e)
    size = torch.zeros(n, dtype=z.dtype).index_add(0, inv, torch.ones_like(z))
    adv = size[inv] * e / denom[inv] - 1.0
    return torch.where(group_all_equal(rewards, group_ids), torch.zeros_like(adv), adv)


def _softmax_grpo(batch, temperature: float = 1.0) -> torch.Tensor:
    """SoftmaxGRPO on every loss token of each sequence; [T]."""
    return per_token(batch, softmax_grpo(scalar_rewards(batch), batch.group_ids, temperature))


ADVANTAGE_ESTIMATORS.add("softmax_grpo", _softmax_grpo, PartInfo(group_relative=True))

SPEC = MethodSpec(
    name="softmax_grpo",
    summary="SoftmaxGRPO: softmax-weighted group advantages",
    provenance="reconstructed",
    config={"advantage": {"estimator": "softmax_grpo"}},
)
