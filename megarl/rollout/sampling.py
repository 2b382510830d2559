"""One sampling step of the embedded engine: temperature, top-k / top-p and a seeded draw.

The draw of a request comes from its own generator and always covers all ``n`` rows of the request
(finished samples included), so the random numbers a sample sees depend only on its request's seed
and on the step, never on which other requests decode in the same batch.
"""

from __future__ import annotations

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


def sample_next(logits: torch.Tensor, sp: Any, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [n] of the rows of one request from their fp32 logits [n, V] (greedy at
    temperature 0, else a draw from ``gen`` after temperature and top-k / top-p), and each token's
    raw model logprob [n] (before temperature / top-p)."""
    logp = torch.log_softmax(logits, dim=-1)
    if sp.temperature == 0:
        nxt = logits.argmax(-1)
    else:
        probs = torch.softmax(filter_logits(logits / sp.temperature, sp.top_k, sp.top_p), dim=-1)
        nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    return nxt, logp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
