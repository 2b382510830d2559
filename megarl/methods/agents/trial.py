"""TRIAL: trajectory-relative hindsight distillation (regulariser ``trial``; formula:
reference/agents.py ``trial_hd_per_token``; reconstructed from the abstract).

Each response token is scored by the same weights with and without a hindsight view of the
trajectory's realised outcome in context (``hindsight_logprobs``, megarl/methods/agents/hindsight.py;
``old_logprobs`` without). The signed gap gives each token a direction and local strength; each
turn's mean absolute gap, normalised over the trajectory, allocates the magnitude:

    δ_t = ℓ^hind_t − ℓ^ord_t,  M_k = mean_{t∈T_k} |δ_t|,  m_k = M_k / (Σ_j n_j M_j / Σ_j n_j),
    L_HD,t = −m_{k(t)} · sg(δ_t) · log π_θ(y_t)   (eligible tokens: model tokens inside turns),
    L = L_GRPO + λ L_HD   (λ: the regulariser's ``coef``; L_HD aggregated like the policy loss).

The multipliers have an eligible-token-weighted mean of 1 per trajectory. Sequences without a
hindsight context have δ ≡ 0. The multipliers need whole trajectories: sequences are never split
across micro-batches or data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.methods.agents import hindsight
from megarl.methods.agents.context_pass import context_logprobs
from megarl.methods.agents.turns import on_turn_tokens, token_turns, turn_counts, turn_sums
from megarl.objectives.regularisers import REGULARISERS
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo


def trial_multipliers(gap: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(m [B, K] float64, turn of each token [T]) for the per-token gap δ [T]; m ≡ 1 on a
    trajectory whose gaps are all 0, and on turns without eligible tokens."""
    turn, K = token_turns(batch)
    seq = batch.seq_index()
    n = turn_counts(turn, seq, batch.num_seqs, K)
    M = turn_sums(gap.abs(), turn, seq, batch.num_seqs, K) / n.clamp(min=1)
    norm = (n * M).sum(1, keepdim=True) / n.sum(1, keepdim=True).clamp(min=1)
    m = torch.where(norm > 0, M / torch.where(norm > 0, norm, 1.0), torch.ones_like(M))
    return torch.where(n > 0, m, torch.ones_like(m)), turn


def trial(logits, logp, old_logp, batch, ctx) -> torch.Tensor:
    """Per-token L_HD [T] (module docstring); gradient only through ``logp``."""
    ordinary = old_logp.detach().double()
    hind = context_logprobs(batch, hindsight.LOGPROBS, hindsight.ON, ordinary)
    gap = hind - ordinary
    m, turn = trial_multipliers(gap, batch)
    seq = batch.seq_index().to(turn.device)
    eligible = (turn >= 0).double()
    coef = on_turn_tokens(m, turn, seq) * gap * eligible
    return -coef.to(logp.dtype) * logp


REGULARISERS.add("trial", trial, PartInfo(batch_inputs=("old_logprobs", hindsight.LOGPROBS)))


@dataclass
class TRIALKnobs(Knobs):
    """No knobs of its own: λ is the ``trial`` regulariser's ``coef``; the hindsight view is
    ``inputs.hindsight_context``."""


SPEC = MethodSpec(
    name="trial",
    summary="TRIAL: hindsight-gap distillation with trajectory-normalised turn multipliers, added to GRPO",
    provenance="reconstructed",
    config={
        "advantage": {"estimator": "grpo"},
        "objective": {"regularisers": [{"name": "trial", "coef": 0.5}]},
        "inputs": {"hindsight_context": {"template": "{verdict}{outcome}="}},
    },
    knobs=TRIALKnobs,
)
