"""One sampling step of the embedded engine: temperature, top-k / top-p and a seeded draw.

The draw of a request comes from its own generator and always covers all ``n`` rows of the request
(finished samples included), so the random numbers a sample sees depend only on its request's seed
and on the step, never on which other requests decode in the same batch.

``sample_rows`` samples the rows of every request in a batch at once: the logprobs, the filters and
the softmax run once over all rows of requests with the same (temperature, top-k, top-p), and only
the draw is made per request. The draw is the exponential race that ``torch.multinomial`` runs for
one sample per row (noise ``E ~ Exp(1)`` of the rows' shape from the request's generator, the token
``argmax(p / E)``), so a request's tokens and logprobs are bit for bit those of
``torch.multinomial(p, 1, generator=gen)`` on its rows alone: every operation is row-wise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits [B, V] outside top-k / the top-p nucleus with -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits


def sample_rows(
    logits: torch.Tensor, parts: Sequence[tuple[int, Any, torch.Generator]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [B] of a batch of requests from their fp32 logits [B, V] and each token's raw
    model logprob [B] (before temperature / top-p). ``parts``: ``(n, sampling, generator)`` of each
    request, in row order (its ``n`` rows follow the previous request's). Greedy at temperature 0
    (no draw), else one draw per request from its generator after temperature and top-k / top-p."""
    B = int(logits.shape[0])
    groups: dict[tuple[float, int, float], list[tuple[int, int, torch.Generator]]] = {}
    row = 0
    for n, sp, gen in parts:
        groups.setdefault((float(sp.temperature), int(sp.top_k), float(sp.top_p)), []).append((row, n, gen))
        row += n
    if row != B:
        raise ValueError(f"sample_rows: the requests have {row} rows, the logits {B}")
    nxt = torch.empty(B, dtype=torch.long)
    for (temperature, top_k, top_p), members in groups.items():
        if len(groups) == 1:
            idx, sub = None, logits
        else:
            idx = torch.cat([torch.arange(r, r + n) for r, n, _ in members])
            sub = logits.index_select(0, idx)
        if temperature == 0:
            tok = sub.argmax(-1)
        else:
            probs = torch.softmax(filter_logits(sub / temperature, top_k, top_p), dim=-1)
            V = int(probs.shape[-1])
            noise = [torch.empty(n, V).exponential_(1, generator=gen) for _, n, gen in members]
            tok = (probs / (noise[0] if len(noise) == 1 else torch.cat(noise))).argmax(-1)
        if idx is None:
            nxt = tok
        else:
            nxt[idx] = tok
    logp = torch.log_softmax(logits, dim=-1)
    return nxt, logp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)


def sample_next(logits: torch.Tensor, sp: Any, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [n] of the rows of one request from their fp32 logits [n, V] (greedy at
    temperature 0, else a draw from ``gen`` after temperature and top-k / top-p), and each token's
    raw model logprob [n] (before temperature / top-p)."""
    return sample_rows(logits, [(int(logits.shape[0]), sp, gen)])
