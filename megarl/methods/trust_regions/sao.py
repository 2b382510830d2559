"""SAO strict double-sided token clipping (formula and provenance: reference/trust_regions.py:sao_clip).
Registered as the policy loss ``sao_clip``. The ratio is to the behaviour policy: the batch's
``rollout_logprobs`` (else ``old_logprobs``). Needs no group statistics (one rollout per prompt);
SAO's value-model designs belong to the critic family.
"""

from __future__ import annotations

import torch

from megarl.batch import PackedBatch
from megarl.objectives.policy_losses import POLICY_LOSSES
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo


def _ratio_and_keep(logp, old_logp, batch, clip_low, clip_high):
    behav = batch.rollout_logprobs if batch.rollout_logprobs is not None else old_logp
    r = torch.exp(logp - behav.to(logp.dtype))
    rd = r.detach()
    return r, (rd >= 1 - clip_low) & (rd <= 1 + clip_high)


def sao_clip(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=0.2,
    clip_high=0.28,
    dual_clip=None,
    *,
    batch: PackedBatch,
    ctx=None,
) -> torch.Tensor:
    """−1[1−ε_l ≤ r ≤ 1+ε_h]·r·A per token, r = π_θ/π_behaviour ([T] -> [T]); dual_clip unused."""
    r, keep = _ratio_and_keep(logp, old_logp, batch, clip_low, clip_high)
    return -keep.to(logp.dtype) * r * adv


def _token_metrics(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=0.2,
    clip_high=0.28,
    dual_clip=None,
    *,
    batch: PackedBatch,
    ctx=None,
) -> dict[str, torch.Tensor]:
    """Share of tokens outside the band (zero gradient)."""
    _, keep = _ratio_and_keep(logp, old_logp, batch, clip_low, clip_high)
    return {"out_of_band_frac": (~keep).to(logp.dtype)}


POLICY_LOSSES.add("sao_clip", sao_clip, PartInfo(needs_context=True, token_metrics=_token_metrics))

SPEC = MethodSpec(
    name="sao",
    summary="SAO's clipping: ratio clip on the sequences it keeps",
    provenance="reconstructed",
    config={"objective": {"policy_loss": "sao_clip"}},
)
