"""Token log-probabilities and entropy from full-vocabulary logits.

Provenance: textbook definitions.
"""

import torch


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens) under softmax(logits).

    logp[b, t] = logits[b, t, tokens[b, t]] - log Σ_v exp(logits[b, t, v])

    logits: [B, L, V] (already aligned: logits[b, t] scored tokens[b, t]); tokens: [B, L] -> [B, L]
    """
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the full vocabulary.

    H[b, t] = -Σ_v p_v log p_v,   p = softmax(logits[b, t])

    logits: [B, L, V] -> [B, L]
    """
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """log Σ_v exp(logits_v).  logits: [..., V] -> [...]"""
    return torch.logsumexp(logits, -1)


def topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits and their vocabulary ids (ties broken towards the lower id).

    logits: [..., V] -> (values [..., k], ids [..., k])
    """
    return torch.topk(logits, k, dim=-1, sorted=True)
