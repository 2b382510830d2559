"""PGPO: advantages from anchor-state potential differences across trajectories
(formula: reference/credit.py)."""

from __future__ import annotations

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, grpo, scalar_rewards
from megarl.methods.credit.steps import anchor_groups, batch_steps, discounted_returns, steps_to_tokens
from megarl.ops.segments import group_mean
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo


def pgpo_step_advantages(
    batch,
    gamma: float = 1.0,
    omega: float = 1.0,
    normalise: bool = True,
    eps: float = 1e-6,
    role: str = "assistant",
):
    """(steps, per-step advantages [N], episode advantages [B]) of a multi-turn batch."""
    rewards = scalar_rewards(batch)
    steps = batch_steps(batch, role)
    episode = grpo(rewards, batch.group_ids, eps=eps)
    ret = discounted_returns(steps, batch.num_seqs, gamma)
    phi = group_mean(ret, anchor_groups(batch.group_ids, steps))  # Φ(s_{i,t}) per step
    S = int(steps.counts.max()) if steps.counts.numel() else 0
    grid = torch.zeros(batch.num_seqs, S + 1, dtype=torch.float64)  # Φ after the last step = 0
    grid[steps.seq, steps.index] = phi
    phi_next = grid[steps.seq, steps.index + 1]
    a_s = steps.reward + gamma * phi_next - phi
    if normalise:
        a_s = grpo(a_s, batch.group_ids[steps.seq], eps=eps)
    return steps, episode[steps.seq] + omega * a_s, episode


def _pgpo(
    batch,
    gamma: float = 1.0,
    omega: float = 1.0,
    normalise: bool = True,
    eps: float = 1e-6,
    role: str = "assistant",
) -> torch.Tensor:
    """PGPO advantage on the tokens of each step; [T]."""
    steps, step_adv, episode = pgpo_step_advantages(batch, gamma, omega, normalise, eps, role)
    return steps_to_tokens(step_adv, episode, steps, batch)


ADVANTAGE_ESTIMATORS.add("pgpo", _pgpo, PartInfo(batch_inputs=("steps",)))

SPEC = MethodSpec(
    name="pgpo",
    summary="PGPO: step-level advantages on GiGPO's anchor states",
    provenance="reconstructed",
    config={"advantage": {"estimator": "pgpo"}, "environment": {"name": "retry"}},
)
