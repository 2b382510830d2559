"""Rank 0's processors of a rollout round: reward shaping, judges, scores made with the run's engines.

The rollout collector (megarl/trainer/collector.py) scores each round of samples with the run's
reward functions, then runs every ``RoundProcessor`` of the run in order: a processor may replace
the scalar rewards the advantages see (shaping) and add per-sample ``extras`` (e.g. scores a
credit method reads). Processors are coroutines, so judge calls and anchor rollouts share the
engine with generation in both the synchronous and the asynchronous loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass
class RolloutRound:
    """One rollout round on rank 0: ``n`` samples per prompt, prompts in order.

    prompts/answers/uids: [G] prompt texts, ground truths, stable prompt ids (dataset rows);
    prompt_ids: [G] token ids; response_ids/texts: [G * n]; dims: name -> [G * n] reward
    dimensions; scalar: [G * n] their weighted sum (after earlier processors: the shaped value);
    weights: name -> the reward function's weight; correct: [G * n] bool, the verdicts of the reward
    marked as the correctness check (megarl/rewards/correctness.py), None when there is none;
    extras: name -> [G * n] per-sample values the rollout workflow attached (a float or a row each).
    """

    prompts: list[str]
    answers: list[str]
    uids: list[int]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    texts: list[str]
    dims: dict[str, torch.Tensor]
    scalar: torch.Tensor
    n: int
    step: int
    round: int
    weights: dict[str, float] = field(default_factory=dict)
    correct: torch.Tensor | None = None
    extras: dict[str, list] = field(default_factory=dict)


@dataclass
class RoundResult:
    """What a processor returns: ``scalar`` [G * n] (None: unchanged), per-sample ``extras``
    (name -> [G * n]) and metrics."""

    scalar: torch.Tensor | None = None
    extras: dict[str, list[float]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class RoundProcessor(Protocol):
    """``await process(round)`` -> ``RoundResult``; its state goes in checkpoints."""

    async def process(self, r: RolloutRound) -> RoundResult: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...
