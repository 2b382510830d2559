"""TASPO: outcome-grounded action credit from privileged supervision (advantage estimator
``taspo``; formula: reference/agents.py ``taspo_advantages``; reconstructed from the abstract).

The trajectory's GRPO advantage A fixes the direction and the mean scale; the shift of each
action's (assistant turn's) log-likelihood when the policy reads verified-success PI
(``pi_logprobs``: the PI bank, megarl/methods/agents/pi_bank.py) against without it
(``old_logprobs``, the same weights) only redistributes A over the actions, through positive,
bounded, token-weighted-mean-1 weights:

    Δ_k = mean_{t∈a_k} (ℓ^PI_t − ℓ^S_t),  z_k = (Δ_k − mean Δ)/(std Δ + δ),
    ŵ_k = 1 + λ tanh(sign(A) z_k),  w_k = clip(c ŵ_k, w_lo, w_hi) with Σ_k |a_k| w_k = Σ_k |a_k|,
    A_t = w_{k(t)} A,  then the usual PPO-clip loss.

A sequence without PI (its prompt has no verified success yet) has Δ ≡ 0, so w ≡ 1 (GRPO).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, grpo, scalar_rewards
from megarl.methods.agents import pi_bank
from megarl.methods.agents.context_pass import context_logprobs
from megarl.methods.agents.turns import (
    TurnWeightStats,
    check_bounds,
    mean_preserving_weights,
    on_turn_tokens,
    token_turns,
    turn_counts,
    turn_sums,
)
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo


def own_logprobs(batch, who: str) -> torch.Tensor:
    """ℓ^S [T] float64: the policy's own logprobs (``old_logprobs``); the error names ``who``."""
    if batch.old_logprobs is None:
        raise ValueError(f"{who} needs the batch field 'old_logprobs' (the policy's own logprobs)")
    return batch.old_logprobs.double()


def relative_support(delta: torch.Tensor, valid: torch.Tensor, eps: float) -> torch.Tensor:
    """z_k = (Δ_k − mean Δ)/(std Δ + eps) over each row's valid turns (population std); 0 on rows
    whose valid Δ are all equal and on invalid turns. [B, K] -> [B, K] float64."""
    v = valid.double()
    cnt = v.sum(1, keepdim=True).clamp(min=1)
    mean = (delta * v).sum(1, keepdim=True) / cnt
    std = (((delta - mean) ** 2 * v).sum(1, keepdim=True) / cnt).sqrt()
    big = torch.where(valid, delta, torch.full_like(delta, -float("inf"))).max(1, keepdim=True).values
    small = torch.where(valid, delta, torch.full_like(delta, float("inf"))).min(1, keepdim=True).values
    z = (delta - mean) / (std + eps)
    return torch.where(valid & (big != small), z, torch.zeros_like(z))


def taspo_weights(batch, lam=0.5, w_lo=0.25, w_hi=2.0, delta=1e-6, scale_by_std=True, eps=1e-6):
    """(A [B], w [B, K], turn of each token [T], n [B, K]) of a batch (module docstring)."""
    check_bounds(lam, w_lo, w_hi, "advantage")
    adv = grpo(scalar_rewards(batch), batch.group_ids, scale_by_std, eps)
    s_logp = own_logprobs(batch, "advantage.estimator=taspo")
    pi = context_logprobs(batch, pi_bank.LOGPROBS, pi_bank.ON, s_logp)
    turn, K = token_turns(batch)
    seq = batch.seq_index()
    n = turn_counts(turn, seq, batch.num_seqs, K)
    valid = n > 0
    d = turn_sums(pi - s_logp, turn, seq, batch.num_seqs, K) / n.clamp(min=1)
    z = relative_support(d, valid, delta)
    w_hat = 1 + lam * torch.tanh(torch.sign(adv)[:, None] * z)
    return adv, mean_preserving_weights(w_hat, n, w_lo, w_hi), turn, n


def spread_advantages(batch, adv: torch.Tensor, w: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    """[T] float64: w_{k(t)} A on each turn's eligible tokens, A on other loss tokens, 0 off the loss."""
    seq = batch.seq_index()
    return adv[seq] * on_turn_tokens(w, turn, seq, fill=1.0) * batch.loss_mask.double()


def _taspo(
    batch, lam=0.5, w_lo=0.25, w_hi=2.0, delta=1e-6, scale_by_std=True, eps=1e-6, state=None
) -> torch.Tensor:
    """TASPO token advantages [T]; ``state`` (a ``TurnWeightStats``) keeps the weights' diagnostics."""
    adv, w, turn, n = taspo_weights(batch, lam, w_lo, w_hi, delta, scale_by_std, eps)
    if state is not None:
        state.record(w, n)
    return spread_advantages(batch, adv, w, turn)


ADVANTAGE_ESTIMATORS.add(
    "taspo",
    _taspo,
    PartInfo(
        batch_inputs=("old_logprobs", pi_bank.LOGPROBS), make_state=lambda **_: TurnWeightStats("taspo")
    ),
)


@dataclass
class TASPOKnobs(Knobs):
    """No knobs of its own: λ, bounds and δ are ``advantage.lam / w_lo / w_hi / delta``; the PI bank's
    are ``inputs.pi_context``."""


SPEC = MethodSpec(
    name="taspo",
    summary="TASPO: PI-shift action credit, positive bounded mean-preserving weights on the GRPO advantage",
    provenance="reconstructed",
    config={
        "advantage": {"estimator": "taspo", "lam": 0.5, "w_lo": 0.25, "w_hi": 2.0},
        "inputs": {"pi_context": {"capacity": 1024}},
    },
    knobs=TASPOKnobs,
)
