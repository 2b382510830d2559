"""Train/rollout mismatch corrections: detached per-token multipliers of the policy loss.

``fn(old_logp, rollout_logp, mask, cu_seqlens, low, high) -> [T]``; formulas in reference/corrections.py.
All equal plain IS, w = exp(old_logp - rollout_logp), when no threshold triggers.
"""

from __future__ import annotations

import torch

from megarl.ops.segments import broadcast_to_tokens, segment_masked_mean
from megarl.registry import Registry

CORRECTIONS: Registry = Registry("mismatch_correction")


def _w(old_logp, rollout_logp):
    return torch.exp(old_logp - rollout_logp).detach()


@CORRECTIONS.register("none")
def none(old_logp, rollout_logp, mask, cu_seqlens, low, high):
    return torch.ones_like(old_logp)


@CORRECTIONS.register("tis")
def tis(old_logp, rollout_logp, mask, cu_seqlens, low, high):
    return torch.clamp(_w(old_logp, rollout_logp), max=high)


@CORRECTIONS.register("mis")
def mis(old_logp, rollout_logp, mask, cu_seqlens, low, high):
    w = _w(old_logp, rollout_logp)
    return w * (w <= high).to(w.dtype)


@CORRECTIONS.register("icepop")
def icepop(old_logp, rollout_logp, mask, cu_seqlens, low, high):
    w = _w(old_logp, rollout_logp)
    return w * ((w >= low) & (w <= high)).to(w.dtype)


@CORRECTIONS.register("seq_geo_mask")
def seq_geo_mask(old_logp, rollout_logp, mask, cu_seqlens, low, high):
    rho = torch.exp(segment_masked_mean((old_logp - rollout_logp).detach(), mask, cu_seqlens))
    keep = broadcast_to_tokens(((rho >= low) & (rho <= high)).to(old_logp.dtype), cu_seqlens)
    return _w(old_logp, rollout_logp) * keep
