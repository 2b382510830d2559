"""SAPO (Single-rollout Autoregressive Policy Optimization): one rollout per prompt, PPO on
turn-level GAE, values read from a head on the policy's own trunk at the turns' causal boundaries,
and an on-policy SARSA auxiliary (formulas: reference/critics.py ``sapo_turn_gae``,
``batch_normalise``, ``sapo_head_loss``).

The actions of a trajectory are its runs of loss tokens (one for a single-turn answer; the
assistant turns of a multi-turn episode whose observations are masked out). V(s_t) is the value
head at the last token before action t, which is ``batch.values`` at the action's first token
(values are aligned to the state before each token), Q(s_t, a_t) the head at the action's last
token.

- ``sapo_gae`` (an advantage estimator): r_t the token rewards summed over action t,
  δ_t = r_t + γ V(s_{t+1}) − V(s_t) (0 after the last action), A_t = Σ_l (γλ)^l δ_{t+l}; Â is A
  normalised over all the batch's actions (mean 0, std 1) and broadcast to the action's tokens;
  ``batch.returns`` = the λ-return G_t = A_t + V(s_t) on the action's tokens.
- the value head (``inputs.values: {model: trunk, boundaries: true, sarsa_coef: c_Q}``):
  L = ½ mean_t (V(s_t) − sg G_t)² + c_Q · ½ mean_t (Q_t − sg[r_t + γ Q_{t+1}])², its own Adam step.
- the policy: PPO clip on Â.

Provenance: reconstructed (the sources were not found). The head reads the policy's hidden states
detached, the "gradient stopping between the heads" reading of "independently optimizing"; the
joint reading (value gradients into the shared trunk) is not built.
"""

from __future__ import annotations

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, gae, token_rewards, whiten
from megarl.batch import PackedBatch
from megarl.methods.critics.trunk import action_spans, turn_rewards
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo


def turn_advantages(
    batch: PackedBatch, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A [S] not normalised, G^λ [S], span_of_token [T]) over the batch's actions."""
    first, _last, seq, span = action_spans(batch)
    S = first.numel()
    r = turn_rewards(batch, span, S, token_rewards(batch))
    v_state = batch.values.double()[first]
    counts = torch.bincount(seq, minlength=batch.num_seqs)
    cu = torch.zeros(batch.num_seqs + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(counts, 0)
    adv, ret = gae(r, v_state, torch.ones(S, dtype=torch.float64), cu, gamma, lam)
    return adv, ret, span


def _sapo_gae(batch: PackedBatch, gamma: float = 1.0, lam: float = 1.0, eps: float = 1e-8) -> torch.Tensor:
    """SAPO's batch-normalised turn-level GAE on every token of each action; writes ``batch.returns``."""
    if batch.values is None:
        raise ValueError("advantage_estimator=sapo_gae needs the batch field 'values'")
    adv, ret, span = turn_advantages(batch, gamma, lam)
    norm = whiten(adv, torch.ones_like(adv), eps)
    on = span >= 0
    out = torch.zeros(batch.num_tokens, dtype=torch.float64)
    out[on] = norm[span[on]]
    returns = torch.zeros(batch.num_tokens, dtype=torch.float64)
    returns[on] = ret[span[on]]
    batch.returns = returns.to(batch.values.dtype)
    return out


ADVANTAGE_ESTIMATORS.add("sapo_gae", _sapo_gae, PartInfo(batch_inputs=("values",)))

SPEC = MethodSpec(
    name="sapo",
    summary="SAPO: one rollout per prompt, turn-level GAE and SARSA on a value head on the policy's trunk",
    provenance="reconstructed",
    config={
        "advantage": {"estimator": "sapo_gae", "gamma": 1.0, "lam": 1.0},
        "objective": {"policy_loss": "ppo"},
        "inputs": {"values": {"model": "trunk", "boundaries": True, "sarsa_coef": 1.0}},
    },
)
