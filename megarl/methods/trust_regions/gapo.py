"""GAPO: clip bounds adapted to each rollout's advantage magnitude, on the PPO or GSPO surrogate
(formula and provenance: reference/trust_regions.py:gapo). Registered as the policy loss ``gapo``.

ā (mean |A| over the global batch) is one statistic of the whole batch: ``prepare`` computes it
(one all-reduce of two floats over DP) and stores each sequence's factor (a_i/ā)^κ in
``batch.extras['gapo_scale']``; the loss turns it into bounds with clip_low/clip_high.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.objectives.policy_losses import POLICY_LOSSES
from megarl.ops import comm
from megarl.ops.segments import broadcast_to_tokens, segment_masked_mean, segment_sum
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo

SCALE = "gapo_scale"


def prepare(batch: PackedBatch, dp_group: Any, state: Any = None, *, kappa: float = 1.0, **_) -> PackedBatch:
    """extras['gapo_scale'] [B] = (a_i/ā)^κ, a_i = masked mean |A|, ā over the global batch."""
    if batch.advantages is None:
        raise ValueError("gapo needs the batch field 'advantages' before prepare (compute advantages first)")
    dt = torch.float64
    m = batch.loss_mask.to(dt)
    a = segment_masked_mean(batch.advantages.to(dt).abs(), m, batch.cu_seqlens)
    has = segment_sum(m, batch.cu_seqlens) > 0
    stats = torch.stack([a[has].sum(), has.sum().to(dt)])
    comm.all_reduce(stats, "sum", dp_group)
    abar = stats[0] / stats[1].clamp(min=1)
    scale = (a / abar) ** kappa if abar > 0 else torch.ones_like(a)
    return dataclasses.replace(batch, extras={**batch.extras, SCALE: scale})


def bounds(
    batch: PackedBatch,
    clip_low: float,
    clip_high: float,
    eps_min: float,
    eps_max: float,
    adapt_low: bool,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence (ε_l, ε_h) [B] from the prepared scale."""
    if SCALE not in batch.extras:
        raise ValueError(
            "gapo: batch.extras has no 'gapo_scale': call objective.prepare(batch, dp_group) "
            "on the whole batch before splitting it into micro-batches"
        )
    f = batch.extras[SCALE].to(dtype)
    hi = torch.clamp(clip_high * f, eps_min, eps_max)
    lo = torch.clamp(clip_low * f, eps_min, eps_max) if adapt_low else torch.full_like(f, clip_low)
    return lo, hi


def gapo(
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
    kappa: float = 1.0,
    eps_min: float = 0.1,
    eps_max: float = 1.0,
    adapt_low: bool = True,
    surrogate: str = "ppo",
) -> torch.Tensor:
    """PPO/GSPO clip with per-rollout bounds clip(ε·(a_i/ā)^κ, ε_min, ε_max); [T] -> [T]."""
    if surrogate not in ("ppo", "gspo"):
        raise ValueError(f"gapo: policy_loss_args.surrogate={surrogate!r}; allowed: ppo, gspo")
    lo, hi = (
        broadcast_to_tokens(x, cu_seqlens)
        for x in bounds(batch, clip_low, clip_high, eps_min, eps_max, adapt_low, logp.dtype)
    )
    if surrogate == "gspo":
        r = broadcast_to_tokens(torch.exp(segment_masked_mean(logp - old_logp, mask, cu_seqlens)), cu_seqlens)
    else:
        r = torch.exp(logp - old_logp)
    loss = torch.maximum(-r * adv, -torch.clamp(r, 1 - lo, 1 + hi) * adv)
    if dual_clip is not None and surrogate == "ppo":
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    return loss


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
    kappa: float = 1.0,
    eps_min: float = 0.1,
    eps_max: float = 1.0,
    adapt_low: bool = True,
    surrogate: str = "ppo",
) -> dict[str, torch.Tensor]:
    """Mean adapted bounds per token."""
    lo, hi = bounds(batch, clip_low, clip_high, eps_min, eps_max, adapt_low, logp.dtype)
    return {"clip_low": broadcast_to_tokens(lo, cu_seqlens), "clip_high": broadcast_to_tokens(hi, cu_seqlens)}


POLICY_LOSSES.add("gapo", gapo, PartInfo(needs_context=True, prepare=prepare, token_metrics=_token_metrics))

SPEC = MethodSpec(
    name="gapo",
    summary="GAPO: clip bounds adapted to the group's advantage scale",
    provenance="reconstructed",
    config={"objective": {"policy_loss": "gapo"}},
)
