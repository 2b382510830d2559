"""Loss aggregation with global normalisers (exact under micro-batching and data parallelism).

Each mode returns this micro-batch's contribution; contributions of all micro-batches on all DP
ranks sum to the reference aggregation of the whole global batch (reference/aggregation.py):
  token-mean                Σ m ℓ / N_tok
  token-sum                 Σ m ℓ
  seq-mean-token-mean       Σ_b (Σ_t m ℓ / n_b) / N_seq
  seq-mean-token-sum        Σ m ℓ / N_seq
  seq-mean-token-sum-norm   Σ m ℓ / (N_seq · L_max)
N_tok, N_seq, L_max come from GlobalNormalisers (global batch). Sequences must not be split
across micro-batches (n_b is a per-sequence count).
"""

from __future__ import annotations

import torch

from megarl.objectives.api import GlobalNormalisers
from megarl.ops.segments import segment_sum

MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate(
    loss: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, mode: str, norm: GlobalNormalisers
) -> torch.Tensor:
    """loss, mask: [T] -> scalar contribution of this micro-batch to the global aggregate."""
    m = mask.to(loss.dtype)
    masked = loss * m
    if mode == "token-mean":
        return masked.sum() / max(norm.num_tokens, 1.0)
    if mode == "token-sum":
        return masked.sum()
    if mode == "seq-mean-token-mean":
        n = segment_sum(m, cu_seqlens)
        per_seq = segment_sum(masked, cu_seqlens) / n.clamp(min=1)
        return per_seq.sum() / max(norm.num_seqs, 1.0)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(norm.num_seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / (max(norm.num_seqs, 1.0) * max(norm.max_response_len, 1.0))
    raise KeyError(f"unknown aggregation {mode!r}; allowed: {', '.join(MODES)}")
