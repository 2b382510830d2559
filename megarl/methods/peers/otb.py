"""Optimal token baseline (OTB): a baseline per group and per response position, weighted by the
accumulated squared norm of the score function (formula: reference/peers.py:optimal_token_baseline).

It needs Σ_v π_v² of every response token under the sampling policy: the round input
``sum_pi_squared`` (rank 0) computes it with the embedded engine's in-process model, one forward
pass per response, and stores it per sample, padded with NaN to ``rollout.max_new_tokens``
(``extras["sum_pi_squared"]`` [B, max_new_tokens]). The estimator ``otb`` reads it with π_old's
log-probs and refuses a sequence whose loss tokens are not its generated tokens (multi-turn).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, _compact, scalar_rewards
from megarl.ops.segments import _dense_groups
from megarl.plugin.inputs import InputProvider, register_provider
from megarl.plugin.rounds import RolloutRound, RoundResult
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo

SUM_PI_SQ = "sum_pi_squared"


def optimal_token_baseline(
    rewards: torch.Tensor,
    old_logp: torch.Tensor,
    sum_pi_sq: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    group_ids: torch.Tensor,
    eps: float = 1e-8,
) -> torch.Tensor:
    """A_t = R − B_{g,k} at the k-th loss token; B_{g,k} = Σ_i R_i W_{i,k} / (Σ_i W_{i,k} + ε) over the
    group's responses with a k-th token, W the cumulative 1 − 2π + Σπ²; old_logp, sum_pi_sq, mask [T]
    -> [T] (0 off the mask; a group of one has baseline 0)."""
    tok, s, col, counts, N = _compact(mask, mask, cu_seqlens)
    B = counts.numel()
    w = torch.zeros(B, N, dtype=torch.float64)
    w[s, col] = 1 - 2 * torch.exp(old_logp[tok].double()) + sum_pi_sq[tok].double()
    W = torch.cumsum(w, 1)[s, col]  # [n_loss]
    inv, n_groups = _dense_groups(group_ids)
    size = torch.bincount(inv, minlength=n_groups)
    key = inv[s] * N + col
    r = rewards.double()[s]
    num = torch.zeros(n_groups * N, dtype=torch.float64).index_add(0, key, r * W)
    den = torch.zeros(n_groups * N, dtype=torch.float64).index_add(0, key, W)
    base = torch.where(size[inv[s]] > 1, num[key] / (den[key] + eps), torch.zeros_like(r))
    out = torch.zeros(cu_seqlens[-1].item(), dtype=torch.float64)
    out[tok] = r - base
    return out


def token_values(batch, name: str = SUM_PI_SQ) -> torch.Tensor:
    """extras[name] [B, width] (NaN-padded per response token) on the loss tokens: [T]; a sequence
    whose loss-token count differs from its value count is an error."""
    if name not in batch.extras:
        raise ValueError(f"advantage.estimator=otb needs batch.extras[{name!r}] (the round input {name})")
    v = batch.extras[name].double()
    tok, s, col, counts, _ = _compact(batch.loss_mask, batch.loss_mask, batch.cu_seqlens)
    have = (~torch.isnan(v)).sum(1) if v.numel() else torch.zeros(batch.num_seqs, dtype=torch.long)
    bad = (have != counts).nonzero().flatten()
    if bad.numel():
        b = int(bad[0])
        raise ValueError(
            f"{name}: sequence {b} has {int(counts[b])} loss tokens but {int(have[b])} values (otb needs "
            "single-turn responses: the loss tokens are the generated tokens)"
        )
    out = torch.zeros(batch.num_tokens, dtype=torch.float64)
    out[tok] = v[s, col]
    return out


def _otb(batch, eps: float = 1e-8) -> torch.Tensor:
    """OTB advantages; [T]."""
    old = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
    if old is None:
        raise ValueError("advantage.estimator=otb needs 'old_logprobs' or 'rollout_logprobs'")
    return optimal_token_baseline(
        scalar_rewards(batch),
        old,
        token_values(batch),
        batch.loss_mask,
        batch.cu_seqlens,
        batch.group_ids,
        eps,
    )


@torch.no_grad()
def sum_pi_squared(
    model: Any, prompt_ids: list[int], response_ids: list[int], temperature: float
) -> list[float]:
    """Σ_v π_v² at each response token, π = softmax(logits / temperature) given the prefix."""
    if not response_ids:
        return []
    ids = torch.tensor([list(prompt_ids) + list(response_ids)], dtype=torch.long)
    logits = model(input_ids=ids).logits[0].double()
    P, R = len(prompt_ids), len(response_ids)
    z = logits[P - 1 : P + R - 1] / (temperature if temperature > 0 else 1.0)
    return torch.softmax(z, -1).pow(2).sum(-1).tolist()


class SumPiSquared:
    """A ``RoundProcessor``: ``extras['sum_pi_squared']`` [G * n] rows of ``width`` (NaN-padded) from
    the embedded engine's model. Stateless."""

    def __init__(self, model: Any, temperature: float, width: int):
        self.model, self.temperature, self.width = model, temperature, width

    async def process(self, r: RolloutRound) -> RoundResult:
        """Σπ² of every response token of the round."""
        rows = []
        for i, resp in enumerate(r.response_ids):
            vals = sum_pi_squared(self.model, r.prompt_ids[i // r.n], resp, self.temperature)
            if len(vals) > self.width:
                raise ValueError(
                    f"sum_pi_squared: a response of {len(vals)} tokens exceeds rollout.max_new_tokens"
                )
            rows.append(vals + [math.nan] * (self.width - len(vals)))
        flat = [x for row in rows for x in row if not math.isnan(x)]
        return RoundResult(
            extras={SUM_PI_SQ: rows}, metrics={"otb/sum_pi_sq_mean": sum(flat) / max(len(flat), 1)}
        )

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _build(ctx: Any, names: frozenset) -> SumPiSquared:
    if ctx.cfg.rollout.engine != "embedded":
        raise ValueError(
            "the sum_pi_squared input (advantage.estimator=otb) needs rollout.engine: embedded (the "
            "full-vocabulary probabilities come from the engine's in-process model)"
        )
    return SumPiSquared(
        ctx.engine.model, float(ctx.cfg.rollout.temperature), int(ctx.cfg.rollout.max_new_tokens)
    )


register_provider(
    InputProvider(
        (SUM_PI_SQ,),
        "round",
        _build,
        summary="Σπ² of every response token under the sampling policy (rank 0, embedded engine)",
    )
)
ADVANTAGE_ESTIMATORS.add("otb", _otb, PartInfo(batch_inputs=(SUM_PI_SQ,), group_relative=True))

SPEC = MethodSpec(
    name="otb",
    summary="Optimal token baseline: per-position group baseline weighted by the score-function norm",
    provenance="code",
    config={"advantage": {"estimator": "otb"}},
)
