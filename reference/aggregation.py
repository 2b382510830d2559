"""Loss aggregation: how per-token losses become one scalar.

mask m[b, t] ∈ {0, 1}, n_b = Σ_t m[b, t], S = number of sequences with n_b > 0:
  token-mean                Σ_bt m ℓ / Σ_bt m
  token-sum                 Σ_bt m ℓ
  seq-mean-token-mean       (1/S) Σ_b [Σ_t m ℓ / n_b]
  seq-mean-token-sum        (1/S) Σ_b Σ_t m ℓ
  seq-mean-token-sum-norm   Σ_bt m ℓ / (S · L_max)        L_max a constant (Dr.GRPO)
Provenance: the modes offered by peers (verl agg_loss; Dr.GRPO, Liu et al. 2025, for the constant).
"""

import torch

MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate(
    loss: torch.Tensor, mask: torch.Tensor, mode: str, max_len: float | None = None
) -> torch.Tensor:
    """Aggregate per-token losses with one of MODES.

    loss, mask: [B, L]; max_len: the L_max constant of seq-mean-token-sum-norm (defaults to the
    longest response in the batch). Returns a scalar.
    """
    m = mask.to(loss.dtype)
    per_seq_sum = (loss * m).sum(-1)  # [B]
    n = m.sum(-1)  # [B]
    has = n > 0
    S = has.sum().clamp(min=1)
    if mode == "token-mean":
        return per_seq_sum.sum() / m.sum().clamp(min=1)
    if mode == "token-sum":
        return per_seq_sum.sum()
    if mode == "seq-mean-token-mean":
        return (per_seq_sum[has] / n[has]).sum() / S
    if mode == "seq-mean-token-sum":
        return per_seq_sum.sum() / S
    if mode == "seq-mean-token-sum-norm":
        L = max_len if max_len else float(n.max().clamp(min=1))
        return per_seq_sum.sum() / (S * L)
    raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {MODES}")
