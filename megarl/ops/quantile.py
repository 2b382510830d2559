"""Batch-global quantile gates over a data-parallel group, exact.

A gate such as "keep the tokens whose entropy is in the top 20% of the batch" needs the quantile of
the *global* batch, while each data-parallel rank holds a share of it. These functions all-gather
the statistic itself (the values, not a histogram), so the threshold on every rank is the one the
whole batch on one rank would give, bit for bit: the gathered values are the same multiset, and
sorting does not depend on their order.

``x`` is a 1-D tensor of the values that take part on this rank (select them with a mask first:
``x[mask.bool()]``); a rank may hold any number of them, none included. ``group`` is a process
group, ``None`` (one rank) or a simulated group (megarl.ops.comm).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megarl.ops import comm


def gather_variable(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Every rank's values of the 1-D ``x`` (counts may differ), concatenated in rank order."""
    if x.dim() != 1:
        raise ValueError(f"gather_variable: x must be 1-D, got shape {tuple(x.shape)}")
    if comm.world_size(group) == 1:
        return x
    counts = [int(c) for c in comm.all_gather(torch.tensor([x.numel()], dtype=torch.long), group)]
    padded = torch.zeros(max(counts), dtype=x.dtype, device=x.device)
    padded[: x.numel()] = x
    parts = comm.all_gather(padded, group)
    return torch.cat([p[:c] for p, c in zip(parts, counts)])


def global_quantile(x: torch.Tensor, q: float, group: Any = None) -> torch.Tensor:
    """The ``q``-quantile (linear interpolation, as ``torch.quantile``) of the values of all ranks."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"global_quantile: q={q!r} must be in [0, 1]")
    allx = gather_variable(x.detach(), group)
    if allx.numel() == 0:
        raise ValueError("global_quantile: no values on any rank (the quantile of nothing is undefined)")
    return torch.quantile(allx.double(), q).to(x.dtype)


def top_count(n: int, frac: float) -> int:
    """How many of ``n`` values the top ``frac`` keeps: ceil(frac·n) (float noise below 1e-9 ignored)."""
    if not 0.0 <= frac <= 1.0:
        raise ValueError(f"top fraction {frac!r} must be in [0, 1]")
    return min(n, max(0, math.ceil(frac * n - 1e-9)))


def top_fraction_threshold(x: torch.Tensor, frac: float, group: Any = None) -> torch.Tensor:
    """The k-th largest value of all ranks, k = ceil(frac·N) over the N values of all ranks; ``+inf``
    when k = 0 (nothing is kept). ``x >= threshold`` keeps exactly k values when they are distinct
    (ties at the threshold are all kept)."""
    allx = gather_variable(x.detach(), group)
    k = top_count(allx.numel(), frac)
    if k == 0:
        return torch.tensor(math.inf, dtype=x.dtype, device=x.device)
    return torch.topk(allx, k).values[-1]


def top_fraction_mask(x: torch.Tensor, frac: float, group: Any = None) -> torch.Tensor:
    """[N] bool: this rank's values that are in the global top ``frac`` (``x >= top_fraction_threshold``)."""
    return x >= top_fraction_threshold(x, frac, group)
