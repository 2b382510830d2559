"""REINFORCE on the rollout's own samples, π_old = π_rollout (no recomputed old log-probs), two ways
(formulas: reference/peers.py):

- ``bypass_reinforce`` (verl's bypass mode): weighted by a truncated importance ratio π_θ/π_rollout;
- ``dro``: a quadratic penalty ½β(logp − roll)² on the log-ratio to the sampler instead.
"""

from __future__ import annotations

import torch

from megarl.batch import PackedBatch
from megarl.objectives.policy_losses import POLICY_LOSSES
from megarl.ops.segments import broadcast_to_tokens, segment_sum
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo

LEVELS = ("none", "token", "sequence")


def is_weights(logp, roll_logp, mask, cu_seqlens, is_level: str, is_threshold: float) -> torch.Tensor:
    """Detached IS weight per token: 1, min(π_θ/π_roll, C), or the sequence's product ratio, min C."""
    if is_level not in LEVELS:
        raise ValueError(f"objective.policy_loss_args.is_level={is_level!r}; allowed: {', '.join(LEVELS)}")
    d = (logp - roll_logp).detach()
    if is_level == "none":
        return torch.ones_like(logp)
    if is_level == "token":
        return torch.clamp(torch.exp(d), max=is_threshold)
    s = segment_sum(d * mask.to(d.dtype), cu_seqlens)
    return broadcast_to_tokens(torch.clamp(torch.exp(s), max=is_threshold), cu_seqlens)


def bypass_reinforce(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=None,
    clip_high=None,
    dual_clip=None,
    *,
    batch: PackedBatch,
    ctx=None,
    is_level: str = "token",
    is_threshold: float = 2.0,
) -> torch.Tensor:
    """−sg(w) · A · logp, w against the rollout log-probs; [T] -> [T]."""
    if batch.rollout_logprobs is None:
        raise ValueError("policy_loss=bypass_reinforce needs the batch field 'rollout_logprobs'")
    roll = batch.rollout_logprobs.to(logp.dtype)
    return -is_weights(logp, roll, mask, cu_seqlens, is_level, is_threshold) * adv * logp


def _token_metrics(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=None,
    clip_high=None,
    dual_clip=None,
    *,
    batch,
    ctx=None,
    is_level="token",
    is_threshold=2.0,
):
    """Mean IS weight and the share of truncated weights."""
    roll = batch.rollout_logprobs.to(logp.dtype)
    w = is_weights(logp, roll, mask, cu_seqlens, is_level, is_threshold)
    return {"is_weight": w, "truncated_frac": (w >= is_threshold).to(logp.dtype)}


POLICY_LOSSES.add(
    "bypass_reinforce", bypass_reinforce, PartInfo(needs_context=True, token_metrics=_token_metrics)
)


def dro(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=None,
    clip_high=None,
    dual_clip=None,
    *,
    batch: PackedBatch,
    ctx=None,
    beta: float = 0.05,
) -> torch.Tensor:
    """−A · logp + ½ β (logp − roll)², roll the rollout log-probs; [T] -> [T]."""
    if batch.rollout_logprobs is None:
        raise ValueError("policy_loss=dro needs the batch field 'rollout_logprobs'")
    if not beta >= 0:
        raise ValueError(f"objective.policy_loss_args.beta={beta!r} must be >= 0")
    return -adv * logp + 0.5 * beta * (logp - batch.rollout_logprobs.to(logp.dtype)) ** 2


POLICY_LOSSES.add("dro", dro, PartInfo(needs_context=True))

SPEC = MethodSpec(
    name="bypass",
    summary="Bypass mode: REINFORCE on the rollout log-probs with a truncated IS weight",
    provenance="code",
    config={"objective": {"policy_loss": "bypass_reinforce"}, "schedule": {"old_logprobs": "rollout"}},
)
DRO = MethodSpec(
    name="dro",
    summary="DRO: REINFORCE on the rollout log-probs with a quadratic log-ratio penalty",
    provenance="paper",
    config={"objective": {"policy_loss": "dro"}, "schedule": {"old_logprobs": "rollout"}},
)
