"""Per-token policy-gradient surrogates on packed tensors, registered by name.

Every loss has the signature ``fn(logp, old_logp, adv, mask, cu_seqlens, clip_low, clip_high,
dual_clip) -> [T]``; the formulas and provenance are in reference/policy_losses.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megarl.ops.segments import broadcast_to_tokens, segment_masked_mean
from megarl.registry import Registry

PolicyLoss = Callable[..., torch.Tensor]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy_loss")


def seq_to_tokens(per_seq: torch.Tensor, seq_lens: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-sequence values [B] repeated over each sequence's tokens [T], in ``like``'s dtype and
    device (a loss's per-sequence weight or mask read from ``batch.extras``)."""
    return per_seq.to(like.dtype).to(like.device).repeat_interleave(seq_lens.to(like.device))


@POLICY_LOSSES.register("ppo")
def ppo(logp, old_logp, adv, mask, cu_seqlens, clip_low=0.2, clip_high=0.28, dual_clip: float | None = None):
    """PPO clip with asymmetric bounds and optional dual clip (A < 0)."""
    ratio = torch.exp(logp - old_logp)
    loss = torch.maximum(-ratio * adv, -torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv)
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    return loss


@POLICY_LOSSES.register("gspo")
def gspo(logp, old_logp, adv, mask, cu_seqlens, clip_low=3e-4, clip_high=4e-4, dual_clip=None):
    """GSPO: clip the length-normalised sequence ratio; the sequence loss sits on each of its tokens."""
    s = torch.exp(segment_masked_mean(logp - old_logp, mask, cu_seqlens))  # [B]
    s_tok = broadcast_to_tokens(s, cu_seqlens)
    return torch.maximum(-s_tok * adv, -torch.clamp(s_tok, 1 - clip_low, 1 + clip_high) * adv)


@POLICY_LOSSES.register("cispo")
def cispo(logp, old_logp, adv, mask, cu_seqlens, clip_low=1e9, clip_high=0.28, dual_clip=None):
    """CISPO: stop-gradient clipped IS weight times A times logp."""
    w = torch.clamp(torch.exp(logp - old_logp).detach(), max(1 - clip_low, 0.0), 1 + clip_high)
    return -w * adv * logp


def _dppo(logp, old_logp, adv, valid_pos, valid_neg):
    valid = torch.where(adv > 0, valid_pos, valid_neg).to(logp.dtype).detach()
    return -adv * torch.exp(logp - old_logp) * valid


@POLICY_LOSSES.register("dppo_tv")
def dppo_tv(logp, old_logp, adv, mask, cu_seqlens, clip_low=0.2, clip_high=0.28, dual_clip=None):
    """DPPO, total-variation trust region on the sampled token's probability."""
    dp = torch.exp(logp) - torch.exp(old_logp)
    return _dppo(logp, old_logp, adv, dp <= clip_high, dp >= -clip_low)


@POLICY_LOSSES.register("dppo_kl")
def dppo_kl(logp, old_logp, adv, mask, cu_seqlens, clip_low=0.2, clip_high=0.28, dual_clip=None):
    """DPPO, binary-KL trust region on the sampled token."""
    p, p_old = torch.exp(logp), torch.exp(old_logp)
    tiny = torch.finfo(logp.dtype).tiny
    kl_b = p_old * (old_logp - logp) + (1 - p_old) * (
        torch.log((1 - p_old).clamp(min=tiny)) - torch.log((1 - p).clamp(min=tiny))
    )
    return _dppo(logp, old_logp, adv, (kl_b <= clip_high) | (p <= p_old), (kl_b <= clip_low) | (p >= p_old))


@POLICY_LOSSES.register("none")
def no_policy_loss(logp, old_logp, adv, mask, cu_seqlens, clip_low=0.0, clip_high=0.0, dual_clip=None):
    """No policy-gradient term (pure distillation or pure regulariser runs)."""
    return torch.zeros_like(logp)
