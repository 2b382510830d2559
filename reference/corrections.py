"""Train/rollout mismatch corrections.

The rollout engine samples with π_roll (its own kernels, maybe another precision); the learner
recomputes π_old for the same tokens. The per-token weight w_t = exp(old_logp - rollout_logp)
corrects for the gap. Each correction returns a detached per-token multiplier c_t for the policy
loss; when no threshold triggers, every one of them equals plain IS, c_t = w_t.

  none              c = 1
  tis               c = min(w, C)                              truncated IS (Yao et al. 2025)
  mis               c = w · 1[w <= C]                          masked IS: drop tokens above the cap
  icepop            c = w · 1[α <= w <= β]                     IcePop: two-sided token filter
  seq_geo_mask      c = w · 1[lo <= ρ_b <= hi],  ρ_b = exp(mean_t log w_t)   sequence geometric-mean mask
Papers: truncated IS: Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL";
IcePop: Ring-1T (inclusionAI 2025).
Provenance: the papers named above, as implemented by peers (verl rollout_corr); thresholds are knobs.
"""

import torch


def is_weight(old_logp: torch.Tensor, rollout_logp: torch.Tensor) -> torch.Tensor:
    """w = exp(old_logp - rollout_logp), detached.  [B, L] -> [B, L]"""
    return torch.exp(old_logp - rollout_logp).detach()


def tis(old_logp, rollout_logp, cap: float = 2.0):
    """Truncated IS: c = min(w, C)."""
    return torch.clamp(is_weight(old_logp, rollout_logp), max=cap)


def mis(old_logp, rollout_logp, cap: float = 2.0):
    """Masked IS: c = w where w <= C, else 0."""
    w = is_weight(old_logp, rollout_logp)
    return w * (w <= cap).to(w.dtype)


def icepop(old_logp, rollout_logp, low: float = 0.5, high: float = 5.0):
    """IcePop token filter: c = w where α <= w <= β, else 0."""
    w = is_weight(old_logp, rollout_logp)
    return w * ((w >= low) & (w <= high)).to(w.dtype)


def seq_geo_mask(old_logp, rollout_logp, mask, low: float = 0.5, high: float = 2.0):
    """Sequence geometric-mean mask: keep a whole sequence (with token IS weights) when
    ρ_b = exp(mean over its response tokens of log w) lies in [lo, hi].  mask: [B, L]"""
    m = mask.to(old_logp.dtype)
    logw = (old_logp - rollout_logp).detach() * m
    rho = torch.exp(logw.sum(-1) / m.sum(-1).clamp(min=1))  # [B]
    keep = ((rho >= low) & (rho <= high)).to(old_logp.dtype).unsqueeze(-1)
    return is_weight(old_logp, rollout_logp) * keep
