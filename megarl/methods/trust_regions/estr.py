"""ESTR: entropy-scaled trust region for asynchronous RL (formula and provenance:
reference/trust_regions.py:estr). Registered as the policy loss ``estr``.

Uses only tensors of the training forward: the current policy's full-vocabulary entropy comes
from the same vocab-parallel pass that gives logp (``needs_entropy``), the behaviour log-probs
from the batch (``rollout_logprobs``, else ``old_logprobs``). No extra forward, no policy-version
bookkeeping in the loss.
"""

from __future__ import annotations

import torch

from megarl.batch import PackedBatch
from megarl.objectives.policy_losses import POLICY_LOSSES
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo


def _check(eps: float, kappa: float, h_min: float, is_cap: float) -> None:
    for name, v in (("eps", eps), ("h_min", h_min), ("is_cap", is_cap)):
        if not v > 0:
            raise ValueError(f"estr: policy_loss_args.{name}={v!r} must be > 0")
    if not kappa >= 0:
        raise ValueError(f"estr: policy_loss_args.kappa={kappa!r} must be >= 0")


def _deviation_and_keep(logp, old_logp, batch, entropy, eps, kappa, h_min):
    if entropy is None:
        raise ValueError(
            "estr needs the current policy's entropy (declared needs_entropy; call it through RLObjective)"
        )
    behav = batch.rollout_logprobs if batch.rollout_logprobs is not None else old_logp
    delta = (logp - behav.to(logp.dtype)).detach()
    keep = delta.abs() <= eps * torch.clamp(entropy.detach(), min=h_min) ** kappa
    return delta, keep


def estr(
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
    entropy: torch.Tensor | None = None,
    eps: float = 0.5,
    kappa: float = 1.0,
    h_min: float = 0.05,
    is_cap: float = 2.0,
) -> torch.Tensor:
    """−1[|δ| ≤ ε·max(H, H_min)^κ] · sg(min(e^δ, C)) · A · logp per token; clip_* are unused."""
    _check(eps, kappa, h_min, is_cap)
    delta, keep = _deviation_and_keep(logp, old_logp, batch, entropy, eps, kappa, h_min)
    return -keep.to(logp.dtype) * torch.clamp(torch.exp(delta), max=is_cap) * adv * logp


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
    entropy=None,
    eps: float = 0.5,
    kappa: float = 1.0,
    h_min: float = 0.05,
    is_cap: float = 2.0,
) -> dict[str, torch.Tensor]:
    """Share of tokens outside the entropy-scaled region, and |δ|."""
    delta, keep = _deviation_and_keep(logp, old_logp, batch, entropy, eps, kappa, h_min)
    return {"masked_frac": (~keep).to(logp.dtype), "deviation_abs": delta.abs()}


def calibrate_kappa(
    delta: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, h_min: float = 0.05
) -> float:
    """κ from a logged batch: least-squares slope of log|δ| on log max(H, H_min) over loss tokens
    with δ ≠ 0 (the spec's calibration of the entropy scaling). delta, entropy, mask: [T]."""
    keep = (mask > 0) & (delta != 0)
    x = torch.log(torch.clamp(entropy[keep].double(), min=h_min))
    y = torch.log(delta[keep].double().abs())
    xc = x - x.mean()
    return float((xc * (y - y.mean())).sum() / (xc * xc).sum().clamp(min=1e-300))


POLICY_LOSSES.add(
    "estr", estr, PartInfo(needs_context=True, needs_entropy=True, token_metrics=_token_metrics)
)

SPEC = MethodSpec(
    name="estr",
    summary="ESTR: an entropy-scaled trust region on the sampled token",
    provenance="reconstructed",
    config={"objective": {"policy_loss": "estr"}},
)
