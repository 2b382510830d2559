"""Rule-based reward floor against verbatim copying (formula: reference/reward_shaping.py)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from megarl.plugin.rounds import RolloutRound, RoundResult
from megarl.plugin.spec import MethodSpec
from megarl.rewards.shaping.base import RoundShaper
from megarl.rewards.shaping.registry import REWARD_SHAPERS


def ngram_precision(response: Sequence, source: Sequence, n: int = 3) -> float:
    """Share of the response's n-grams (with multiplicity) found in the source (n shrinks to the
    response length; empty response: 0). Works on words or token ids."""
    n = min(n, len(response))
    if n == 0:
        return 0.0
    src = {tuple(source[j : j + n]) for j in range(len(source) - n + 1)}
    grams = Counter(tuple(response[j : j + n]) for j in range(len(response) - n + 1))
    return sum(c for g, c in grams.items() if g in src) / (len(response) - n + 1)


def words(text: str) -> str:
    """``text`` with every run of non-alphanumeric characters turned into one space (the floor
    compares words: ``"R 407="`` -> ``"R 407"``, so copying the operand is a copy)."""
    return " ".join(re.findall(r"\w+", text))


@REWARD_SHAPERS.register("reward_floor")
class RewardFloor(RoundShaper):
    """``floor(rewards [B], responses, sources) -> (rewards [B], copied [B] bool)``: a response whose
    word n-gram precision against its source text is >= ``threshold`` gets ``floor``."""

    def __init__(self, n: int = 3, threshold: float = 0.5, floor: float = 0.0):
        if n < 1:
            raise ValueError(f"reward_floor: n={n} must be >= 1")
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"reward_floor: threshold={threshold} must be in (0, 1]")
        self.n, self.threshold, self.floor = n, threshold, floor

    def copied(self, responses: Sequence[str], sources: Sequence[str]) -> torch.Tensor:
        """[B] bool: response i copies source i."""
        if len(responses) != len(sources):
            raise ValueError(f"reward_floor: {len(responses)} responses but {len(sources)} sources")
        return torch.tensor(
            [
                ngram_precision(r.lower().split(), s.lower().split(), self.n) >= self.threshold
                for r, s in zip(responses, sources)
            ],
            dtype=torch.bool,
        )

    def __call__(self, rewards: torch.Tensor, responses: Sequence[str], sources: Sequence[str]):
        copied = self.copied(responses, sources)
        if copied.numel() != rewards.shape[0]:
            raise ValueError(f"reward_floor: {rewards.shape[0]} rewards but {copied.numel()} responses")
        return torch.where(copied, torch.full_like(rewards, self.floor), rewards), copied

    async def shape_round(self, r: RolloutRound, env: Any) -> RoundResult:
        """The floor applied to the round: the source text is each sample's prompt (quickstart
        stand-in for the task's document), compared word by word (``words``)."""
        sources = [words(p) for p in r.prompts for _ in range(r.n)]
        shaped, copied = self(r.scalar, [words(t) for t in r.texts], sources)
        return RoundResult(shaped, metrics={"shaping/reward_floor/copied_frac": float(copied.float().mean())})

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


SPEC = MethodSpec(
    name="reward_floor",
    summary="RLAIF reward floor: no reward for copying the source",
    provenance="reconstructed",
    config={"reward": {"shaping": {"name": "reward_floor"}}},
)
