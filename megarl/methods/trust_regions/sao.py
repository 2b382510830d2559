"""SAO strict double-sided token clipping (formula and provenance: reference/trust_regions.py:sao_clip).
Registered as the policy loss ``sao_clip``. The ratio is to the behaviour policy: the batch's
``rollout_logprobs`` (else ``old_logprobs``). Needs no group statistics (one rollout per prompt);
SAO's value-model designs belong to the critic family. Knob ``max_out_of_band`` (policy_loss_args,
default off): a sequence whose share of out-of-band loss tokens exceeds it is masked as a whole
(reconstructed).
"""

from __future__ import annotations

import torch

from megarl.batch import PackedBatch
from megarl.objectives.policy_losses import POLICY_LOSSES
from megarl.ops.segments import broadcast_to_tokens, segment_sum
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo


def _ratio_and_keep(logp, old_logp, batch, clip_low, clip_high):
    behav = batch.rollout_logprobs if batch.rollout_logprobs is not None else old_logp
    r = torch.exp(logp - behav.to(logp.dtype))
    rd = r.detach()
    return r, (rd >= 1 - clip_low) & (rd <= 1 + clip_high)


def _sequence_keep(keep, mask, cu_seqlens, max_out_of_band):
    """1 on the tokens of sequences whose out-of-band share of loss tokens is <= max_out_of_band."""
    if max_out_of_band is None:
        return torch.ones_like(keep)
    if isinstance(max_out_of_band, bool) or not isinstance(max_out_of_band, (int, float)):
        raise ValueError(f"objective.policy_loss_args.max_out_of_band={max_out_of_band!r} must be a number")
    if not 0 <= max_out_of_band <= 1:
        raise ValueError(f"objective.policy_loss_args.max_out_of_band={max_out_of_band!r} must lie in [0, 1]")
    m = mask.to(torch.float64)
    out = segment_sum((~keep).to(torch.float64) * m, cu_seqlens)
    frac = out / segment_sum(m, cu_seqlens).clamp(min=1)
    return broadcast_to_tokens((frac <= max_out_of_band).to(torch.float64), cu_seqlens) > 0


def sao_clip(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=0.2,
    clip_high=0.28,
    dual_clip=None,
    max_out_of_band: float | None = None,
    *,
    batch: PackedBatch,
    ctx=None,
) -> torch.Tensor:
    """−1[1−ε_l ≤ r ≤ 1+ε_h]·r·A per token, r = π_θ/π_behaviour ([T] -> [T]); dual_clip unused.
    ``max_out_of_band``: also 0 on every token of a sequence whose out-of-band share exceeds it."""
    r, keep = _ratio_and_keep(logp, old_logp, batch, clip_low, clip_high)
    keep = keep & _sequence_keep(keep, mask, cu_seqlens, max_out_of_band)
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
    max_out_of_band: float | None = None,
    *,
    batch: PackedBatch,
    ctx=None,
) -> dict[str, torch.Tensor]:
    """Share of tokens outside the band (zero gradient) and, with ``max_out_of_band``, of tokens in
    sequences masked as a whole."""
    _, keep = _ratio_and_keep(logp, old_logp, batch, clip_low, clip_high)
    out = {"out_of_band_frac": (~keep).to(logp.dtype)}
    if max_out_of_band is not None:
        seq = _sequence_keep(keep, mask, cu_seqlens, max_out_of_band)
        out["seq_masked_frac"] = (~seq).to(logp.dtype)
    return out


POLICY_LOSSES.add("sao_clip", sao_clip, PartInfo(needs_context=True, token_metrics=_token_metrics))

SPEC = MethodSpec(
    name="sao",
    summary="SAO's clipping: ratio clip on the sequences it keeps",
    provenance="reconstructed",
    config={"objective": {"policy_loss": "sao_clip"}},
)
