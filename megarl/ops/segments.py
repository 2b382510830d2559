"""Segment reductions on packed sequences and on groups of sequences (vectorised, no loops).

Packed tensors are [T, ...] with ``cu_seqlens: [B+1]``; group ops take per-sequence values [B] and
``group_ids: [B]`` (any integers).
"""

from __future__ import annotations

import torch


def token_to_seq(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] index of the sequence of each token."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(torch.arange(lens.numel(), device=cu_seqlens.device), lens)


def segment_sum(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-sequence sums: x [T, ...] -> [B, ...] (differentiable)."""
    idx = token_to_seq(cu_seqlens).to(x.device)
    out = torch.zeros((cu_seqlens.numel() - 1,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    return out.index_add(0, idx, x)


def segment_masked_mean(x: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean over masked-in tokens: [T], [T] -> [B] (0 for a sequence with no token)."""
    m = mask.to(x.dtype)
    return segment_sum(x * m, cu_seqlens) / segment_sum(m, cu_seqlens).clamp(min=1)


def broadcast_to_tokens(per_seq: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Copy a per-sequence value to every token of its sequence: [B, ...] -> [T, ...]."""
    return per_seq[token_to_seq(cu_seqlens).to(per_seq.device)]


def _dense_groups(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    return inv, int(uniq.numel())


def group_sum(x: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sum and size of its group: x [B] -> (sum [B], count [B])."""
    inv, G = _dense_groups(group_ids)
    s = torch.zeros(G, dtype=x.dtype, device=x.device).index_add(0, inv, x)
    c = torch.zeros(G, dtype=x.dtype, device=x.device).index_add(0, inv, torch.ones_like(x))
    return s[inv], c[inv]


def group_mean(x: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Mean of each sequence's group: [B] -> [B]."""
    s, c = group_sum(x, group_ids)
    return s / c


def group_std(x: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Unbiased std of each sequence's group (0 for a group of one): [B] -> [B]."""
    mean = group_mean(x, group_ids)
    ss, c = group_sum((x - mean) ** 2, group_ids)
    return torch.where(c > 1, torch.sqrt(ss / (c - 1).clamp(min=1)), torch.zeros_like(ss))


def group_leave_one_out_mean(x: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Mean of the *other* members of each sequence's group (x itself for a group of one)."""
    s, c = group_sum(x, group_ids)
    return torch.where(c > 1, (s - x) / (c - 1).clamp(min=1), x)


def group_all_equal(x: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """True where every member of the sequence's group has exactly the same value: [B] -> [B] bool."""
    inv, G = _dense_groups(group_ids)
    hi = torch.full((G,), -torch.inf, dtype=x.dtype, device=x.device).scatter_reduce(0, inv, x, "amax")
    lo = torch.full((G,), torch.inf, dtype=x.dtype, device=x.device).scatter_reduce(0, inv, x, "amin")
    return (hi == lo)[inv]
