"""Output Reset (PPO-OR / GRPO-OR): a smooth one-sided squared-margin loss replacing PPO's clip.

Formula and provenance: reference/trust_regions.py:output_reset. Registered as the policy loss
``output_reset``; PPO-OR and GRPO-OR differ only in the advantage estimator.
"""

from __future__ import annotations

import math

import torch

from megarl.objectives.policy_losses import POLICY_LOSSES
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo


def _residual(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, margin: float) -> torch.Tensor:
    return torch.clamp(margin - torch.sign(adv) * (logp - old_logp), min=0.0)


def _check(margin: float, adv_power: float) -> None:
    if not margin > 0:
        raise ValueError(f"output_reset: policy_loss_args.margin={margin!r} must be > 0")
    if not adv_power >= 0:
        raise ValueError(f"output_reset: policy_loss_args.adv_power={adv_power!r} must be >= 0")


def output_reset(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=0.2,
    clip_high=0.28,
    dual_clip=None,
    *,
    margin: float = math.log(1.2),
    adv_power: float = 1.0,
) -> torch.Tensor:
    """½·|A|^p·max(0, m − sign(A)(logp − old))² per token ([T] -> [T]); clip_* and dual_clip are unused."""
    _check(margin, adv_power)
    w = torch.where(adv != 0, adv.abs() ** adv_power, torch.zeros_like(adv))
    return 0.5 * w * _residual(logp, old_logp, adv, margin) ** 2


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
    margin: float = math.log(1.2),
    adv_power: float = 1.0,
) -> dict[str, torch.Tensor]:
    """The abstract's diagnostics, per token: OR residual e, overshoot 1[s·ℓ > m], |ℓ|."""
    lr = logp - old_logp
    moving = adv != 0
    return {
        "residual": _residual(logp, old_logp, adv, margin) * moving,
        "overshoot_frac": ((torch.sign(adv) * lr > margin) & moving).to(logp.dtype),
        "log_ratio_abs": lr.abs(),
    }


POLICY_LOSSES.add("output_reset", output_reset, PartInfo(token_metrics=_token_metrics))

SPEC = MethodSpec(
    name="output_reset",
    summary="Output Reset: a residual that pulls over-moved outputs back",
    provenance="reconstructed",
    config={"objective": {"policy_loss": "output_reset"}},
)
