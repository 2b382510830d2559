"""GPG: plain policy gradient (no ratio, no clip) on group-centred advantages scaled by
α = B / #(R ≠ 0) (formulas: reference/peers.py:gpg_advantages, gpg_loss). Registers the policy
loss and the advantage estimator ``gpg``; the method ``gpg`` sets both."""

from __future__ import annotations

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, per_token, scalar_rewards
from megarl.objectives.policy_losses import POLICY_LOSSES
from megarl.ops.segments import _dense_groups
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo


def gpg_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, f_norm: float = 1.0) -> torch.Tensor:
    """α (R − mean_g R) / f_norm with α = B / #(R ≠ 0); a group of one has baseline 0; [B] -> [B]."""
    if not f_norm > 0:
        raise ValueError(f"gpg: advantage.f_norm={f_norm!r} must be > 0")
    alpha = rewards.numel() / max(int((rewards != 0).sum()), 1)
    inv, n = _dense_groups(group_ids)
    total = torch.zeros(n, dtype=rewards.dtype).index_add(0, inv, rewards)
    size = torch.zeros(n, dtype=rewards.dtype).index_add(0, inv, torch.ones_like(rewards))
    base = torch.where(size > 1, total / size, torch.zeros_like(total))
    return alpha * (rewards - base[inv]) / f_norm


def _gpg_estimator(batch, f_norm: float = 1.0) -> torch.Tensor:
    """GPG advantages on every loss token of each sequence; [T]."""
    return per_token(batch, gpg_advantages(scalar_rewards(batch), batch.group_ids, f_norm))


def gpg_loss(logp, old_logp, adv, mask, cu_seqlens, clip_low=None, clip_high=None, dual_clip=None):
    """−A · logp per token: REINFORCE without importance ratio or clip; [T] -> [T]."""
    return -adv * logp


ADVANTAGE_ESTIMATORS.add("gpg", _gpg_estimator)  # a group of one keeps its reward (baseline 0, as verl)
POLICY_LOSSES.add("gpg", gpg_loss, PartInfo())

SPEC = MethodSpec(
    name="gpg",
    summary="GPG: plain policy gradient on batch-rescaled group-centred advantages",
    provenance="code",
    config={"advantage": {"estimator": "gpg"}, "objective": {"policy_loss": "gpg"}},
)
