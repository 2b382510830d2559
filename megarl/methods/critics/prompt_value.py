"""SAO's prompt-level value: the advantage estimator ``prompt_value`` (formula and provenance:
reference/critics.py ``prompt_value_advantage``; reconstructed).

A_t = G_t − V(x) on every loss token, with G_t the Monte Carlo return (knob ``gamma``, default 1)
and V(x) the value of the prompt: ``batch.values`` at the sequence's first loss token (values are
aligned to the state before each token, so that is the critic read where the prompt ends). One
value per prompt, no bootstrapping; with an outcome reward A = R − V(x). It writes
``batch.returns`` = G_t, so the critic of the ``values`` input regresses toward the Monte Carlo
return (``targets: estimator``).
"""

from __future__ import annotations

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, monte_carlo_returns
from megarl.batch import PackedBatch
from megarl.registry import PartInfo


def prompt_values(batch: PackedBatch) -> torch.Tensor:
    """V(x) per token [T] (float64): each sequence's ``values`` at its first loss token, 0 for a
    sequence without loss tokens."""
    m = batch.loss_mask > 0
    dev = m.device
    seq = batch.seq_index().to(dev)
    T = batch.num_tokens
    idx = torch.where(m, torch.arange(T, device=dev), torch.full((T,), T, device=dev))
    first = torch.full((batch.num_seqs,), T, dtype=torch.long, device=dev).scatter_reduce(0, seq, idx, "amin")
    padded = torch.cat([batch.values.double().to(dev), torch.zeros(1, dtype=torch.float64, device=dev)])
    return padded[first][seq]


def _prompt_value(batch: PackedBatch, gamma: float = 1.0) -> torch.Tensor:
    """A = G − V(x) on the loss tokens; writes ``batch.returns`` = G (Monte Carlo, discount γ)."""
    if batch.values is None:
        raise ValueError("advantage_estimator=prompt_value needs the batch field 'values'")
    m = batch.loss_mask.double()
    G = monte_carlo_returns(batch, gamma)
    batch.returns = G.to(batch.values.dtype)
    return (G - prompt_values(batch)) * m


ADVANTAGE_ESTIMATORS.add("prompt_value", _prompt_value, PartInfo(batch_inputs=("values",)))
