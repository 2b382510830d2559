"""KL estimators between the policy and a reference policy, from sampled-token log-probs.

With log-ratio x = logp_ref - logp (tokens sampled from the policy):
  k1 = -x                       unbiased, high variance, can be negative
  k2 = x² / 2                   biased, low variance; its gradient is the unbiased reverse-KL gradient
  k3 = exp(x) - x - 1           unbiased, low variance, always >= 0
  k3 value with k2 gradient     straight-through: forward k3, backward as k2
Provenance: J. Schulman, "Approximating KL Divergence" (2020); the straight-through variant as
used by peers (verl 'low_var_kl' + 'k2' gradient).
"""

import torch


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = logp - ref_logp.  [B, L] -> [B, L]"""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = (logp - ref_logp)² / 2.  [B, L] -> [B, L]"""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1.  [B, L] -> [B, L]"""
    x = ref_logp - logp
    return torch.exp(x) - x - 1


def kl_k3_value_k2_grad(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Forward value k3, gradient of k2 (straight-through).  [B, L] -> [B, L]"""
    k2 = kl_k2(logp, ref_logp)
    return kl_k3(logp, ref_logp).detach() + k2 - k2.detach()
