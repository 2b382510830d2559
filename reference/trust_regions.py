"""Trust regions, clipping and regularisers (method family 1), padded [B, L], full vocabulary.

Output Reset (PPO-OR / GRPO-OR), CoKL, GAPO, ESTR, SAO strict clipping, EPPO. Every function
returns per-token losses [B, L] (masked by the caller's aggregation) unless it says otherwise.
Notation: logp = log π_θ(y_t), old_logp = log π_old(y_t), A = advantage, r = exp(logp − old_logp).

Provenance: all six papers were available as abstracts only. Each formula below is tagged
[RECON] where it is our reconstruction from the abstract (../shared/specs/methods-a.md and
methods-b.md give the reasoning); constants are knobs with the spec's defaults.
"""

import math

import torch


# --------------------------------------------------------------------------- Output Reset
def output_reset(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                 margin: float = math.log(1.2), adv_power: float = 1.0) -> torch.Tensor:
    """Output Reset (PPO-OR / GRPO-OR): smooth one-sided squared-margin loss in log-ratio space.

    ℓ = logp − old_logp                  rollout-relative token log-ratio
    s = sign(A)
    e = max(0, m − s·ℓ)                  OR residual: distance left to the favourable margin
    loss = ½ · w · e²,   w = |A|^p for A ≠ 0, w = 0 for A = 0
    ∂loss/∂ℓ = −w·s·e: linear in the residual, 0 at and past the margin (C¹, unlike PPO-clip).
    PPO-OR uses GAE advantages, GRPO-OR group-relative ones; the loss is the same.
    Provenance: [RECON] from the abstract's definitions (spec methods-b §25); p and m are not
    given there: p = 1 (advantage magnitude kept), m = log(1 + 0.2) to match PPO's clip range.
    logp, old_logp, adv: [B, L] -> [B, L]
    """
    s = torch.sign(adv)
    e = torch.clamp(margin - s * (logp - old_logp), min=0.0)
    w = torch.where(adv != 0, adv.abs() ** adv_power, torch.zeros_like(adv))
    return 0.5 * w * e ** 2
