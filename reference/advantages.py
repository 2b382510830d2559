"""Advantage estimators.

Outcome rewards R_i for sequences i; groups g(i) hold the G samples of one prompt.
Token-level estimators take padded [B, L] tensors with a mask.
"""

import torch


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor):
    """Per-sequence mean and unbiased std of its group's rewards (loop, for readability)."""
    mean = torch.empty_like(rewards)
    std = torch.empty_like(rewards)
    for g in torch.unique(group_ids):
        sel = group_ids == g
        r = rewards[sel]
        mean[sel] = r.mean()
        std[sel] = r.std(unbiased=True) if r.numel() > 1 else torch.zeros((), dtype=r.dtype)
    return mean, std


def grpo(
    rewards: torch.Tensor, group_ids: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO group-relative advantage.

    A_i = (R_i - mean_g R) / (std_g R + ε)     (std unbiased)
    scale_by_std=False gives Dr.GRPO: A_i = R_i - mean_g R.
    A group whose rewards are all equal gets A = 0 exactly.
    Provenance: DeepSeekMath (Shao et al. 2024); Dr.GRPO (Liu et al. 2025) drops the std.
    rewards, group_ids: [B] -> [B]
    """
    mean, std = _group_stats(rewards, group_ids)
    adv = rewards - mean
    adv = adv / (std + eps) if scale_by_std else adv
    for g in torch.unique(group_ids):  # all rewards equal: exactly 0, not an ulp divided by ε
        sel = group_ids == g
        if rewards[sel].max() == rewards[sel].min():
            adv[sel] = 0.0
    return adv


def dr_grpo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO advantage: A_i = R_i - mean_g R (pair with seq-mean-token-sum-norm aggregation)."""
    return grpo(rewards, group_ids, scale_by_std=False)


def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO leave-one-out baseline: A_i = R_i - (1/(G-1)) Σ_{j≠i} R_j   (0 for a group of one).

    Provenance: Kool et al. 2019; Ahmadian et al. 2024.
    """
    adv = torch.zeros_like(rewards)
    for g in torch.unique(group_ids):
        sel = group_ids == g
        r = rewards[sel]
        G = r.numel()
        if G > 1 and r.max() != r.min():
            adv[sel] = r - (r.sum() - r) / (G - 1)
    return adv


def _whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked entries (std unbiased)."""
    v = x[mask.bool()]
    if v.numel() == 0 or bool(v.max() == v.min()):
        return torch.zeros_like(x)  # all equal: exactly 0, not ulp noise divided by eps
    mean = v.mean()
    std = v.std(unbiased=True) if v.numel() > 1 else torch.zeros((), dtype=x.dtype)
    return (x - mean) / (std + eps) * mask


def reinforce_pp(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
) -> torch.Tensor:
    """REINFORCE++: per-token discounted return of (outcome reward at the last response token
    minus β·KL per token), whitened over all response tokens of the batch.

    r_t = -β kl_t + R·[t is the last response token];   G_t = Σ_{k>=t} γ^(k-t) r_k;   A = whiten(G)
    (the sum runs over response tokens only, as in ``gae``; G is GAE with V = 0 and λ = 1)
    Provenance: REINFORCE++ (Hu et al. 2025).
    rewards: [B]; mask, kl: [B, L] -> [B, L]
    """
    m = mask.to(rewards.dtype)
    r = torch.zeros_like(m) if kl is None else -kl_coef * kl * m
    pos = torch.arange(m.shape[1]).expand_as(m)
    last = torch.where(m > 0, pos, torch.full_like(pos, -1)).max(-1).values  # [B]
    for b in range(m.shape[0]):
        if last[b] >= 0:
            r[b, last[b]] += rewards[b]
    G, _ = gae(r, torch.zeros_like(m), m, gamma=gamma, lam=1.0)
    return _whiten(G, m)


def reinforce_pp_baseline(rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE++ with a group baseline: (R_i - mean_g R) on every response token, whitened
    over all response tokens of the batch.  rewards, group_ids: [B]; mask: [B, L] -> [B, L]
    Provenance: REINFORCE++-baseline (Hu et al. 2025).
    """
    adv = dr_grpo(rewards, group_ids)
    return _whiten(adv.unsqueeze(-1) * mask.to(rewards.dtype), mask)


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response tokens of each sequence.

    δ_t = r_t + γ V_{t+1} - V_t   (V after the last response token is 0)
    Â_t = δ_t + γ λ Â_{t+1};   returns_t = Â_t + V_t
    Only masked-in tokens take part: t+1 means the next response token of the same sequence.
    Provenance: Schulman et al. 2016.
    token_rewards, values, mask: [B, L] -> (advantages [B, L], returns [B, L]), 0 off the mask
    """
    B = mask.shape[0]
    adv = torch.zeros_like(values)
    for b in range(B):
        idx = mask[b].nonzero().flatten().tolist()
        next_v, next_a = 0.0, 0.0
        for t in reversed(idx):
            delta = token_rewards[b, t] + gamma * next_v - values[b, t]
            next_a = delta + gamma * lam * next_a
            adv[b, t] = next_a
            next_v = values[b, t]
    return adv, (adv + values) * mask
