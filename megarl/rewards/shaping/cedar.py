"""CEDAR-GRPO: correctness + evidence coverage + evidence→explanation directionality (formula:
reference/reward_shaping.py). The coverage and directionality come from an LLM judge
(``judge_inputs``, through the rollout engine interface) or, for coverage, a substring matcher."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from megarl.plugin.rounds import RolloutRound, RoundResult
from megarl.plugin.spec import MethodSpec
from megarl.rewards.shaping.base import RoundShaper
from megarl.rewards.shaping.judge import LLMJudge, parse_score, parse_verdicts
from megarl.rewards.shaping.registry import REWARD_SHAPERS

COVERAGE_PROMPT = (
    "Evidence items:\n{items}\n\nExplanation:\n{response}\n\nFor each evidence item say whether the "
    "explanation accounts for it. Answer one line per item as '<number>: yes' or '<number>: no'.\n"
)
DIRECTION_PROMPT = (
    "Evidence:\n{items}\n\nExplanation:\n{response}\n\nIs the explanation derived from the evidence "
    "(1) rather than rationalised after a conclusion (0)? Answer 'score: <number between 0 and 1>'.\n"
)


def substring_coverage(response: str, evidence: Sequence[str]) -> list[int]:
    """covered(e_j, y) = 1 if the evidence text occurs in the response (case-insensitive)."""
    low = response.lower()
    return [int(e.lower().strip() in low) for e in evidence]


def evidence_items(prompt: str) -> list[str]:
    """Quickstart stand-in for CEDAR's evidence: the prompt's distinct digits, in order."""
    return list(dict.fromkeys(re.findall(r"\d", prompt)))


@REWARD_SHAPERS.register("cedar")
class CEDARReward(RoundShaper):
    """``reward(correct [B], covered [B, M], valid [B, M], direction [B]) -> R [B]``.

    gate: ``none`` (process terms always count), ``correct_only`` (only when a = 1) or ``reduced``
    (× ``wrong_weight`` when a = 0).
    """

    def __init__(
        self,
        lambda_c: float = 0.5,
        lambda_d: float = 0.5,
        gate: str = "none",
        wrong_weight: float = 0.5,
        direction_fallback: float = 0.0,
    ):
        if gate not in ("none", "correct_only", "reduced"):
            raise ValueError(f"cedar: gate={gate!r}; allowed: none, correct_only, reduced")
        if lambda_c < 0 or lambda_d < 0 or not 0 <= wrong_weight <= 1:
            raise ValueError("cedar: lambda_c, lambda_d must be >= 0 and wrong_weight in [0, 1]")
        self.lambda_c, self.lambda_d, self.gate, self.wrong_weight = lambda_c, lambda_d, gate, wrong_weight
        self.direction_fallback = direction_fallback

    def __call__(
        self, correct: torch.Tensor, covered: torch.Tensor, valid: torch.Tensor, direction: torch.Tensor
    ) -> torch.Tensor:
        a = correct.double()
        m = valid.double()
        cov = torch.where(
            m.sum(1) > 0, (covered.double() * m).sum(1) / m.sum(1).clamp(min=1), torch.zeros_like(a)
        )
        proc = self.lambda_c * cov + self.lambda_d * direction.double().clamp(0, 1)
        if self.gate == "correct_only":
            proc = proc * a
        elif self.gate == "reduced":
            proc = proc * torch.where(a > 0, torch.ones_like(a), torch.full_like(a, self.wrong_weight))
        return a + proc

    async def judge_inputs(
        self,
        judge: LLMJudge | None,
        responses: Sequence[str],
        evidence: Sequence[Sequence[str]],
        coverage: str = "judge",
    ):
        """(covered [B, M], valid [B, M], direction [B]) for the responses: one coverage call and one
        directionality call per response through ``judge``. A failed coverage call falls back to
        the substring matcher, a failed directionality call to ``direction_fallback``."""
        B = len(responses)
        M = max([len(e) for e in evidence] + [1])
        covered = torch.zeros(B, M, dtype=torch.float64)
        valid = torch.zeros(B, M, dtype=torch.bool)
        items = ["\n".join(f"{j + 1}. {e}" for j, e in enumerate(ev)) for ev in evidence]
        for i, ev in enumerate(evidence):
            valid[i, : len(ev)] = True
            covered[i, : len(ev)] = torch.tensor(substring_coverage(responses[i], ev), dtype=torch.float64)
        direction = torch.full((B,), float(self.direction_fallback), dtype=torch.float64)
        if judge is None:
            return covered, valid, direction
        if coverage == "judge":
            cov_res = await judge.ask_many(
                [COVERAGE_PROMPT.format(items=items[i], response=responses[i]) for i in range(B)],
                parse=lambda t: t,
            )  # parsed below: k differs per response
            for i, r in enumerate(cov_res):
                if r.error is None and evidence[i]:
                    try:
                        covered[i, : len(evidence[i])] = torch.tensor(
                            parse_verdicts(r.value, len(evidence[i])), dtype=torch.float64
                        )
                    except ValueError as e:
                        judge.stats.note("malformed", str(e))
        dir_res = await judge.ask_many(
            [DIRECTION_PROMPT.format(items=items[i], response=responses[i]) for i in range(B)],
            parse=parse_score,
        )
        for i, r in enumerate(dir_res):
            if r.error is None:
                direction[i] = r.value
        return covered, valid, direction

    needs_judge = True

    async def shape_round(self, r: RolloutRound, env: Any) -> RoundResult:
        """Correctness is the verdict of the run's correctness check (``r.correct``; without one, the
        first reward dimension >= 1); the evidence items are the prompt's distinct digits (quickstart
        stand-in, ``evidence_items``); coverage and direction are judged."""
        if r.correct is not None:
            correct = r.correct.double()
        else:
            correct = (r.dims[next(iter(r.weights))] >= 1.0).double()
        evidence = [evidence_items(p) for p in r.prompts for _ in range(r.n)]
        covered, valid, direction = await self.judge_inputs(env.judge, r.texts, evidence)
        shaped = self(correct, covered, valid, direction)
        m = valid.double()
        cov = float(((covered * m).sum(1) / m.sum(1).clamp(min=1)).mean())
        return RoundResult(
            shaped,
            metrics={"shaping/cedar/coverage": cov, "shaping/cedar/direction": float(direction.mean())},
        )

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


SPEC = MethodSpec(
    name="cedar",
    summary="CEDAR-GRPO: correctness plus judged evidence coverage",
    provenance="reconstructed",
    config={"reward": {"shaping": {"name": "cedar"}}},
)
