"""GiGPO: episode-level plus anchor-state step-level relative advantages (formula: reference/credit.py)."""

from __future__ import annotations

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, grpo, scalar_rewards
from megarl.methods.credit.steps import anchor_groups, batch_steps, discounted_returns, steps_to_tokens
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo


def gigpo_step_advantages(
    batch,
    gamma: float = 0.95,
    omega: float = 1.0,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    role: str = "assistant",
):
    """(steps, per-step advantages [N], episode advantages [B]) of a multi-turn batch."""
    rewards = scalar_rewards(batch)
    steps = batch_steps(batch, role)
    episode = grpo(rewards, batch.group_ids, scale_by_std, eps)
    ret = discounted_returns(steps, batch.num_seqs, gamma)
    step_rel = grpo(ret, anchor_groups(batch.group_ids, steps), scale_by_std, eps)
    return steps, episode[steps.seq] + omega * step_rel, episode


def _gigpo(
    batch,
    gamma: float = 0.95,
    omega: float = 1.0,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    role: str = "assistant",
) -> torch.Tensor:
    """GiGPO advantage on the tokens of each step; [T]."""
    steps, step_adv, episode = gigpo_step_advantages(batch, gamma, omega, scale_by_std, eps, role)
    return steps_to_tokens(step_adv, episode, steps, batch)


ADVANTAGE_ESTIMATORS.add("gigpo", _gigpo, PartInfo(batch_inputs=("steps",)))

SPEC = MethodSpec(
    name="gigpo",
    summary="GiGPO: episode plus anchor-state step advantages",
    provenance="paper",
    config={"advantage": {"estimator": "gigpo"}, "environment": {"name": "retry"}},
)
