"""Rewards of a batch of responses: one value per named dimension, weighted sum as the scalar reward."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megarl.rewards.builtin import exact_match, regex_match
from megarl.rewards.correctness import CORRECT_VALUE, correctness_index
from megarl.rewards.sandbox import ContainedFunction, check_reward_value, failure_kind


@dataclass
class RewardResult:
    """``scalar``: [B] weighted sum; ``dims``: name -> [B]; ``correct``: [B] bool, the correctness
    check's verdict (None when several rewards are given and none is marked ``correct``); counts of
    contained failures: ``errors``
    (the function raised, or returned a non-number or a value not finite in float32),
    ``timeouts``, ``worker_deaths`` (the worker process exited or was killed during a call)."""

    scalar: torch.Tensor
    dims: dict[str, torch.Tensor]
    errors: int = 0
    timeouts: int = 0
    worker_deaths: int = 0
    failures: list[str] = field(default_factory=list)  # first few failure messages
    correct: torch.Tensor | None = None


class RewardComputer:
    """Built from ``RewardConfig``; ``__call__(responses, answers) -> RewardResult``."""

    def __init__(self, cfg):
        self.cfg = cfg
        self._fns: list[tuple[str, float, Callable | ContainedFunction]] = []
        for f in cfg.functions:
            if f.kind == "exact_match":
                fn: Callable | ContainedFunction = exact_match
            elif f.kind == "regex":
                pattern = f.pattern
                fn = lambda r, a, _p=pattern: regex_match(r, a, _p)  # noqa: E731
            elif f.kind == "math_verify":
                import importlib.util

                if importlib.util.find_spec("math_verify") is None:
                    raise ValueError(
                        f"reward {f.name!r}: kind 'math_verify' needs the math-verify package "
                        "(pip install math-verify)"
                    )
                fn = ContainedFunction("megarl.rewards.math:math_verify_reward", f.kwargs, cfg.timeout_s)
            else:
                fn = ContainedFunction(f.function, f.kwargs, cfg.timeout_s)
            self._fns.append((f.name, f.weight, fn))
        try:
            self.correct_name: str | None = cfg.functions[correctness_index(cfg.functions)].name
        except ValueError:
            self.correct_name = None  # ambiguous: refused by the trainer's config check

    @property
    def names(self) -> list[str]:
        """The reward dimensions' names."""
        return [n for n, _, _ in self._fns]

    def __call__(self, responses: list[str], answers: list[str]) -> RewardResult:
        B = len(responses)
        dims: dict[str, torch.Tensor] = {}
        counts = {"error": 0, "timeout": 0, "worker_death": 0}
        failures: list[str] = []
        scalar = torch.zeros(B, dtype=torch.float32)
        for name, weight, fn in self._fns:
            vals = torch.zeros(B, dtype=torch.float32)
            for i, (r, a) in enumerate(zip(responses, answers)):
                if isinstance(fn, ContainedFunction):
                    v, why = fn.call(r, a)
                else:
                    v, why = check_reward_value(fn(r, a))
                if v is None:
                    v = self.cfg.fallback
                    counts[failure_kind(why or "error")] += 1
                    if len(failures) < 5:
                        failures.append(f"reward {name!r}, sample {i}: {why}")
                vals[i] = v
            dims[name] = vals
            scalar += weight * vals
        return RewardResult(
            scalar=scalar,
            dims=dims,
            errors=counts["error"],
            timeouts=counts["timeout"],
            worker_deaths=counts["worker_death"],
            failures=failures,
            correct=None if self.correct_name is None else dims[self.correct_name] >= CORRECT_VALUE,
        )

    def close(self) -> None:
        """Stop the worker processes of contained functions."""
        for _, _, fn in self._fns:
            if isinstance(fn, ContainedFunction):
                fn.close()
