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
