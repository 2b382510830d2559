"""AgentOPSD: recursive Bayesian turn-level credit from self-distillation gaps (advantage estimator
``agent_opsd``; formula: reference/agents.py ``agent_opsd_advantages``; reconstructed from the
abstract, anchored on PBSD's posterior-to-prior ratio).

The teacher is the policy itself reading the prompt with privileged context (the self-teacher,
megarl/methods/distillation/self_teacher.py: the reference answer or a correct sibling). Each
assistant turn's summed teacher-student log-likelihood ratio is evidence for "on a successful
path"; a belief in log-odds space starts at the group's success rate and is updated turn by turn:

    e_k = Σ_{t∈T_k} (ℓ^T_t − ℓ^S_t),  L_0 = logit(clip(p̂, ε, 1−ε)),  L_k = ρ L_{k−1} + β e_k,
    b_k = σ(L_k),  Δ_k = b_k − b_{k−1},  ŵ_k = 1 + λ sign(A) Δ_k / (max_k |Δ_k| + δ),
    w = clip(c ŵ, w_lo, w_hi) with token-weighted mean 1 (TASPO's normalisation),  A_t = w_{k(t)} A.

Sequences the self-teacher did not read (no context) have e ≡ 0. p̂ is the group mean of the
round's correctness verdicts (``extras['self_teacher_correct']``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, grpo, scalar_rewards
from megarl.methods.agents.taspo import own_logprobs, spread_advantages
from megarl.methods.agents.turns import (
    TurnWeightStats,
    check_bounds,
    mean_preserving_weights,
    token_turns,
    turn_counts,
    turn_sums,
)
from megarl.methods.distillation.self_teacher import CORRECT, LOGPROBS, ON
from megarl.ops.segments import group_mean
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo


def beliefs(evidence: torch.Tensor, prior: torch.Tensor, rho: float, beta: float, prior_eps: float):
    """b [B, K+1]: σ of the log-odds L_0 = logit(clip(prior)), L_k = ρ L_{k−1} + β e_k."""
    p = prior.double().clamp(prior_eps, 1 - prior_eps)
    L = torch.log(p / (1 - p))
    out = [torch.sigmoid(L)]
    for k in range(evidence.shape[1]):
        L = rho * L + beta * evidence[:, k]
        out.append(torch.sigmoid(L))
    return torch.stack(out, 1)


def compact(x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's valid entries moved left, in order, 0-padded; their column in ``x``), [B, K] each."""
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    return torch.gather(x * valid, 1, order) * torch.gather(valid, 1, order), order


def agent_opsd_weights(
    batch, lam=0.5, rho=1.0, beta=1.0, prior_eps=0.05, delta=1e-6, w_lo=0.25, w_hi=2.0,
    scale_by_std=True, eps=1e-6,
):  # fmt: skip
    """(A [B], w [B, K], turn of each token [T], revisions Δ [B, K]) of a batch (module docstring)."""
    check_bounds(lam, w_lo, w_hi, "advantage")
    if not 0.0 < prior_eps < 0.5:
        raise ValueError(f"advantage.prior_eps={prior_eps} must be in (0, 0.5)")
    adv = grpo(scalar_rewards(batch), batch.group_ids, scale_by_std, eps)
    s_logp = own_logprobs(batch, "advantage.estimator=agent_opsd")
    t_logp = getattr(batch, LOGPROBS)
    if t_logp is None or ON not in batch.extras or CORRECT not in batch.extras:
        raise ValueError(
            f"advantage.estimator=agent_opsd needs '{LOGPROBS}' and the extras '{ON}' and '{CORRECT}' "
            "(the self_teacher_logprobs and self_teacher_context inputs)"
        )
    seq = batch.seq_index()
    t_logp = torch.where(batch.extras[ON].bool()[seq], t_logp.double(), s_logp)
    turn, K = token_turns(batch)
    n = turn_counts(turn, seq, batch.num_seqs, K)
    valid = n > 0
    e, order = compact(turn_sums(t_logp - s_logp, turn, seq, batch.num_seqs, K), valid)
    prior = group_mean(batch.extras[CORRECT].double(), batch.group_ids)
    b = beliefs(e, prior, rho, beta, prior_eps)
    cvalid = torch.gather(valid, 1, order)
    rev_c = (b[:, 1:] - b[:, :-1]) * cvalid
    rev = torch.zeros_like(rev_c).scatter(1, order, rev_c)  # back to the turn columns
    top = rev.abs().max(1, keepdim=True).values
    w_hat = 1 + lam * torch.sign(adv)[:, None] * rev / (top + delta)
    return adv, mean_preserving_weights(w_hat, n, w_lo, w_hi), turn, rev


def _agent_opsd(
    batch, lam=0.5, rho=1.0, beta=1.0, prior_eps=0.05, delta=1e-6, w_lo=0.25, w_hi=2.0,
    scale_by_std=True, eps=1e-6, state=None,
) -> torch.Tensor:  # fmt: skip
    """AgentOPSD token advantages [T]; ``state`` (a ``TurnWeightStats``) keeps the weights' diagnostics."""
    adv, w, turn, _ = agent_opsd_weights(
        batch, lam, rho, beta, prior_eps, delta, w_lo, w_hi, scale_by_std, eps
    )
    if state is not None:
        state.record(w, turn_counts(turn, batch.seq_index(), batch.num_seqs, w.shape[1]))
    return spread_advantages(batch, adv, w, turn)


ADVANTAGE_ESTIMATORS.add(
    "agent_opsd",
    _agent_opsd,
    PartInfo(batch_inputs=("old_logprobs", LOGPROBS), make_state=lambda **_: TurnWeightStats("agent_opsd")),
)


@dataclass
class AgentOPSDKnobs(Knobs):
    """No knobs of its own: λ, ρ, β, ε, δ and the bounds are ``advantage.*``; the teacher's context is
    ``inputs.self_teacher_context``."""


SPEC = MethodSpec(
    name="agent_opsd",
    summary="AgentOPSD: recursive Bayesian turn credit from self-teacher gaps reweights the GRPO advantage",
    provenance="reconstructed",
    config={
        "advantage": {"estimator": "agent_opsd", "lam": 0.5, "rho": 1.0, "beta": 1.0},
        "inputs": {"self_teacher_context": {"source": "answer", "when": "all"}},
    },
    knobs=AgentOPSDKnobs,
)
