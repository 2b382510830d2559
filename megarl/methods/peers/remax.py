"""ReMax: the baseline of each prompt is the reward of its greedy response (formula:
reference/peers.py:remax_advantages).

The greedy responses come through the seam as a round input (``remax_baseline``, rank 0): per
rollout round, one temperature-0 generation per prompt with the run's engine, scored by the run's
reward functions; its scalar reward goes to every sample of the prompt in
``extras["remax_baseline"]``. The estimator ``remax`` subtracts it.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, per_token, scalar_rewards
from megarl.plugin.inputs import InputProvider, register_provider
from megarl.plugin.rounds import RolloutRound, RoundResult
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo

BASELINE = "remax_baseline"


def remax_advantages(rewards: torch.Tensor, baselines: torch.Tensor) -> torch.Tensor:
    """R − b per sequence; [B], [B] -> [B]."""
    return rewards - baselines.to(rewards.dtype)


def _remax(batch) -> torch.Tensor:
    """ReMax advantages on every loss token; [T]."""
    if BASELINE not in batch.extras:
        raise ValueError(
            "advantage.estimator=remax needs batch.extras['remax_baseline'] (the round input "
            "remax_baseline: the reward of each prompt's greedy response)"
        )
    return per_token(batch, remax_advantages(scalar_rewards(batch), batch.extras[BASELINE].double()))


class GreedyBaseline:
    """A ``RoundProcessor``: one greedy response per prompt of the round, scored with the run's
    reward functions; its scalar reward on every sample of the prompt. Stateless.

    engine: the run's rollout engine; decode: token ids -> text; score: ``score(texts, answers)``
    -> the run's ``RewardResult``; sampling: ``sampling(step, round, index, greedy=True)``."""

    def __init__(self, engine: Any, decode: Any, score: Any, sampling: Any):
        self.engine, self.decode, self.score, self.sampling = engine, decode, score, sampling

    async def process(self, r: RolloutRound) -> RoundResult:
        """``extras['remax_baseline']`` [G * n] and the greedy responses' mean reward."""
        texts = []
        for i, ids in enumerate(r.prompt_ids):
            sp = self.sampling(r.step, r.round, i, greedy=True)
            out = await self.engine.generate(ids, n=1, sampling=sp)
            texts.append(self.decode(out.samples[0].token_ids))
        b = self.score(texts, list(r.answers)).scalar.double()
        return RoundResult(
            extras={BASELINE: [float(x) for x in b for _ in range(r.n)]},
            metrics={"remax/baseline_mean": float(b.mean()) if b.numel() else 0.0},
        )

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _build(ctx: Any, names: frozenset) -> GreedyBaseline:
    if ctx.engine is None or ctx.score is None:
        raise ValueError("the remax_baseline input needs rank 0's rollout engine and reward functions")
    return GreedyBaseline(ctx.engine, ctx.tokenizer.decode, ctx.score, ctx.sampling)


register_provider(
    InputProvider(
        (BASELINE,),
        "round",
        _build,
        summary="ReMax's baseline: the reward of each prompt's greedy response (rank 0, each round)",
    )
)
ADVANTAGE_ESTIMATORS.add("remax", _remax, PartInfo(batch_inputs=(BASELINE,)))

SPEC = MethodSpec(
    name="remax",
    summary="ReMax: advantages against the reward of the prompt's greedy response",
    provenance="code",
    config={"advantage": {"estimator": "remax"}},
)
