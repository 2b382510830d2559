"""TACO: tail-aware credit calibration of positive advantages (formula: reference/credit.py).

Applied inside the objective, per micro-batch, with the *current* policy's log-prob and
full-vocabulary entropy (detached), as the authors' dp_actor does before the PPO loss. Registered as
the policy loss ``taco`` that reweights the advantages and then calls a base policy loss, so it
composes with every correction, KL and aggregation of the objective::

    objective:
      policy_loss: taco
      policy_loss_args: {base: ppo, alpha: 0.01, lam: 0.9}
"""

from __future__ import annotations

import math

import torch

from megarl.objectives.policy_losses import POLICY_LOSSES
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo


def taco_weights(
    logp: torch.Tensor, entropy: torch.Tensor, alpha: float = 0.01, lam: float = 0.9
) -> torch.Tensor:
    """w = 1 where r = −logp − H + log α ≤ 0, else 1 − λ(1 − e^{−r}); [T], [T] -> [T], no gradient."""
    if not alpha > 0:
        raise ValueError(f"taco: alpha={alpha!r} must be > 0")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"taco: lam={lam!r} must be in [0, 1]")
    with torch.no_grad():
        r = -logp - entropy + math.log(alpha)
        return torch.where(r > 0, 1.0 - lam * (1.0 - torch.exp(-r.clamp(min=0))), torch.ones_like(r))


def taco_advantages(
    adv: torch.Tensor, logp: torch.Tensor, entropy: torch.Tensor, alpha: float = 0.01, lam: float = 0.9
) -> torch.Tensor:
    """Ã = w·A on tokens with A > 0, A elsewhere; [T] each."""
    w = taco_weights(logp.detach(), entropy.detach(), alpha, lam).to(adv.dtype)
    return torch.where(adv > 0, w * adv, adv)


def taco(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=None,
    clip_high=None,
    dual_clip=None,
    *,
    entropy: torch.Tensor,
    base: str = "ppo",
    alpha: float = 0.01,
    lam: float = 0.9,
    **base_args,
):
    """The ``base`` policy loss on TACO-calibrated advantages; [T]. A clip bound left unset (None)
    is the base loss's own default."""
    if base == "taco":
        raise ValueError("taco: base must be another policy loss")
    shaped = taco_advantages(adv, logp, entropy, alpha, lam)
    clip = {k: v for k, v in (("clip_low", clip_low), ("clip_high", clip_high)) if v is not None}
    return POLICY_LOSSES.get(base)(
        logp, old_logp, shaped, mask, cu_seqlens, dual_clip=dual_clip, **clip, **base_args
    )


POLICY_LOSSES.add("taco", taco, PartInfo(needs_entropy=True))

SPEC = MethodSpec(
    name="taco",
    summary="TACO: token advantages weighted by confidence and entropy",
    provenance="code",
    config={"objective": {"policy_loss": "taco"}},
)
