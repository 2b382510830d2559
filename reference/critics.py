"""Critic (value) losses, padded [B, L] tensors with a response mask.

V are the critic's values now, V_old its values when the rollout was scored (the values GAE used),
R the value targets (GAE returns, V_old + A). Losses are token means over the masked-in tokens.
"""

import torch


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "clipped",
    clip: float = 0.2,
    huber_delta: float = 1.0,
) -> torch.Tensor:
    """Token-mean value loss.

    mse:      ½ (V - R)²
    clipped:  ½ max((V - R)², (V_old + clip(V - V_old, -ε, ε) - R)²)     (PPO's value clip)
    huber:    ½ x² if |x| <= δ else δ (|x| - ½ δ),  x = V - R
    Provenance: PPO (Schulman et al. 2017) and its reference implementations (value clipping);
    Huber (1964).
    values, old_values, returns, mask: [B, L] -> scalar
    """
    m = mask.to(values.dtype)
    err = values - returns
    if kind == "mse":
        per_token = 0.5 * err**2
    elif kind == "clipped":
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        per_token = 0.5 * torch.maximum(err**2, (clipped - returns) ** 2)
    elif kind == "huber":
        a = err.abs()
        per_token = torch.where(a <= huber_delta, 0.5 * err**2, huber_delta * (a - 0.5 * huber_delta))
    else:
        raise ValueError(f"unknown value loss {kind!r}")
    return (per_token * m).sum() / m.sum().clamp(min=1)


def bounded_values(raw: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Values squashed into the reward range: V = low + (high - low) · sigmoid(raw)."""
    return low + (high - low) * torch.sigmoid(raw)


def length_adaptive_lam(length: int, alpha: float) -> float:
    """BPCO's length-adaptive GAE λ for a response of ``length`` tokens: 1 − 1/(α·L), clamped to [0, 1].

    Below L = 1/α the formula turns negative (α = 0.4: L = 2 gives −0.25), which would flip the sign
    of the multi-step terms; the clamp makes such responses one-step TD (λ = 0).
    Provenance: BPCO, the authors' code (QPHutu/golden_critic, compute_lagae_advantage_return; the
    code as read does not clamp); the clamp is megarl's decision.
    """
    if length <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - 1.0 / (alpha * length)))


def lagae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    alpha: float = 0.4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BPCO's advantages and value targets: length-adaptive GAE and Monte Carlo returns.

    λ_i = length_adaptive_lam(L_i, α), L_i the number of response (masked-in) tokens of sequence i
    δ_t = r_t + γ V_{t+1} − V_t          (V after the last response token is 0)
    Â_t = δ_t + γ λ_i Â_{t+1}            (advantages, not whitened)
    R_t = Â^{λ=1}_t + V_t = Σ_k γ^k r_{t+k}   (value targets: the same recursion with λ = 1)
    Only masked-in tokens take part (t+1: the next response token of the same sequence).
    Provenance: BPCO (QPHutu/golden_critic, compute_lagae_advantage_return).
    token_rewards, values, mask: [B, L] -> (advantages [B, L], returns [B, L]), 0 off the mask
    """
    adv = torch.zeros_like(values)
    ret = torch.zeros_like(values)
    for b in range(mask.shape[0]):
        idx = mask[b].nonzero().flatten().tolist()
        lam = length_adaptive_lam(len(idx), alpha)
        next_v, next_a, next_a1 = 0.0, 0.0, 0.0
        for t in reversed(idx):
            delta = token_rewards[b, t] + gamma * next_v - values[b, t]
            next_a = delta + gamma * lam * next_a
            next_a1 = delta + gamma * next_a1
            adv[b, t] = next_a
            ret[b, t] = next_a1 + values[b, t]
            next_v = values[b, t]
    return adv, ret
