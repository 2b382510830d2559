"""GMPO: the geometric mean of log-space-clipped token ratios per sequence (formula:
reference/peers.py:gmpo). Registered as the policy loss ``gmpo``; its sequence loss sits on every
token of the sequence, so ``seq-mean-token-mean`` aggregation is the mean over sequences."""

from __future__ import annotations

import torch

from megarl.objectives.policy_losses import POLICY_LOSSES
from megarl.ops.segments import broadcast_to_tokens, segment_masked_mean
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo


def gmpo(logp, old_logp, adv, mask, cu_seqlens, clip_low=0.4, clip_high=0.4, dual_clip=None):
    """−Ā_b · exp(mean_t sgn(A)·min(sgn(A)·d, sgn(A)·clip(d, −ε_l, ε_h))), d = logp − old; [T] -> [T]."""
    d = logp - old_logp
    sgn = torch.sign(adv)
    d_min = sgn * torch.minimum(sgn * d, sgn * torch.clamp(d, -clip_low, clip_high))
    ratio = torch.exp(segment_masked_mean(d_min, mask, cu_seqlens))  # [B]
    a = segment_masked_mean(adv, mask, cu_seqlens)
    return broadcast_to_tokens(-a * ratio, cu_seqlens)


def _token_metrics(logp, old_logp, adv, mask, cu_seqlens, clip_low=0.4, clip_high=0.4, dual_clip=None):
    """Share of tokens whose log-ratio leaves [−ε_l, ε_h]."""
    d = logp - old_logp
    return {"clipped_frac": ((d < -clip_low) | (d > clip_high)).to(logp.dtype)}


POLICY_LOSSES.add("gmpo", gmpo, PartInfo(token_metrics=_token_metrics))

SPEC = MethodSpec(
    name="gmpo",
    summary="GMPO: geometric-mean sequence ratio of log-space-clipped token ratios",
    provenance="code",
    config={"objective": {"policy_loss": "gmpo", "aggregation": "seq-mean-token-mean"}},
)
