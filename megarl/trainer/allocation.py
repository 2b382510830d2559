"""Allocation: which prompts a step samples, how many rounds, which groups stay in the batch.

An ``Allocator`` is asked, after each rollout round, which of the round's groups to keep and
whether to sample another round. Built in: ``FixedAllocation`` (one round of
``prompts_per_step`` prompts, every group kept) and ``DynamicSampling`` (DAPO: groups whose
rewards are all equal are dropped and more prompts are sampled, up to ``max_rounds`` rounds).

A ``StreamingAllocator`` decides per prompt instead of per round: the rollout collector's streaming
scheduler (megarl/trainer/streaming.py) shows it each prompt's outcomes as its samples land and asks
for a ``target`` (how many samples the prompt should have in all; ``n`` commits the group) or
``ABANDON``; fresh prompts are opened while the step's budget allows. A method contributes one
through ``MethodParts.allocator`` (docs/allocation.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from megarl.plugin.allocation import ABANDON, PromptView, StepBudget, StreamingAllocator
from megarl.registry import Registry

__all__ = ["ABANDON", "ALLOCATORS", "Allocator", "PromptView", "StepBudget", "StreamingAllocator"]


class Allocator(Protocol):
    """Decides per round; ``want`` groups per step."""

    want: int

    def keep(self, rewards: torch.Tensor) -> bool:
        """Whether a group with these (shaped) rewards [n] goes into the batch."""
        ...

    def more(self, kept: int, rounds: int) -> bool:
        """Whether to sample another round after ``rounds`` rounds that kept ``kept`` groups."""
        ...


class FixedAllocation:
    """One round of ``want`` prompts; every group is kept."""

    def __init__(self, want: int, max_rounds: int = 1):
        self.want = want

    def keep(self, rewards: torch.Tensor) -> bool:
        """Always."""
        return True

    def more(self, kept: int, rounds: int) -> bool:
        """Never."""
        return False


class DynamicSampling:
    """Drop zero-variance groups; sample again until ``want`` groups or ``max_rounds`` rounds."""

    def __init__(self, want: int, max_rounds: int):
        self.want, self.max_rounds = want, max_rounds

    def keep(self, rewards: torch.Tensor) -> bool:
        """Keep a group whose rewards differ."""
        return not bool((rewards == rewards[0]).all())

    def more(self, kept: int, rounds: int) -> bool:
        """Until enough informative groups or the round budget is spent."""
        return kept < self.want and rounds < self.max_rounds


ALLOCATORS: Registry[Callable[[int, int], Allocator]] = Registry("allocator")
ALLOCATORS.add("fixed", FixedAllocation)
ALLOCATORS.add("dynamic", DynamicSampling)


def allocator_from_config(cfg) -> Allocator:
    """The run's allocator (``sampling.dynamic`` picks DAPO's dynamic sampling)."""
    name = "dynamic" if cfg.sampling.dynamic else "fixed"
    return ALLOCATORS.get(name)(cfg.schedule.prompts_per_step, cfg.sampling.max_rounds)
