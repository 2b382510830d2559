"""CARE: contrastive anchor-based rubric evolution (formulas: reference/reward_shaping.py).

Per prompt a ``Rubric`` (criteria with weights, a version, per-criterion discrimination statistics)
and a frontier-model anchor response y*. Each step, after the group was scored with the rubric version
fixed for the whole step:

1. y⁺ = the best rollout by rubric reward; Δ = R(y⁺) − R(y*); the judge gives P(y* ≻ y⁺).
2. ``adaptive`` (Δ ≥ 0 but the judge prefers y*: the rubric is hacked) or ``chase`` (Δ < 0): the
   evolver LLM writes one new criterion from the contrast of y⁺ and y* only.
3. The judge scores the new criterion on y* and y⁺; it is accepted only if s(y*) > s(y⁺).
4. At most ``k_max`` criteria: the least discriminative (lowest score variance over recent groups)
   is dropped.

Judge and evolver are ``LLMJudge`` calls through the rollout engine interface; any failed call
(timeout, engine error, malformed reply) leaves the rubric unchanged and is counted.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.plugin.rounds import RolloutRound, RoundResult
from megarl.plugin.spec import MethodSpec
from megarl.rewards.shaping.base import RoundShaper
from megarl.rewards.shaping.judge import LLMJudge, MalformedJudgeOutput, parse_preference, parse_score
from megarl.rewards.shaping.registry import REWARD_SHAPERS

PREFERENCE_PROMPT = (
    "Question:\n{prompt}\n\nResponse A:\n{a}\n\nResponse B:\n{b}\n\nWhich response is better "
    "overall? Answer 'winner: A' or 'winner: B'.\n"
)
EVOLVE_PROMPT = {
    "adaptive": (
        "Question:\n{prompt}\n\nRubric:\n{rubric}\n\nResponse X scores at least as high as reference R on "
        "this rubric, but R is better.\nX:\n{best}\n\nR:\n{anchor}\n\nWrite ONE new criterion that R "
        "satisfies and X does not, closing the loophole X exploits. Answer 'criterion: <text>'.\n"
    ),
    "chase": (
        "Question:\n{prompt}\n\nRubric:\n{rubric}\n\nReference R is still better than response X.\nX:\n{best}"
        "\n\nR:\n{anchor}\n\nWrite ONE sharper criterion that R satisfies and X does not. Answer "
        "'criterion: <text>'.\n"
    ),
}
CRITERION_PROMPT = (
    "Question:\n{prompt}\n\nCriterion: {criterion}\n\nResponse:\n{response}\n\nHow well does the "
    "response satisfy the criterion? Answer 'score: <number between 0 and 1>'.\n"
)


def parse_criterion(text: str) -> str:
    """The text after ``criterion:`` on its line (non-empty)."""
    m = re.search(r"criterion\s*:\s*(.+)", text, flags=re.IGNORECASE)
    if not m or not m.group(1).strip():
        raise MalformedJudgeOutput(f"no 'criterion:' in evolver reply {text[:80]!r}")
    return m.group(1).strip()


def rubric_reward(scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """R = Σ_k w_k s_k / Σ_k w_k; scores [B, K] in [0, 1], weights [K] >= 0 -> [B]."""
    tot = weights.double().sum()
    return (
        (scores.double() @ weights.double()) / tot
        if tot > 0
        else torch.zeros(scores.shape[0], dtype=torch.float64)
    )


def trigger(r_best: float, r_anchor: float, pref_anchor: float) -> str:
    """``adaptive`` | ``chase`` | ``none`` (see the module docstring)."""
    delta = r_best - r_anchor
    return "adaptive" if delta >= 0 and pref_anchor > 0.5 else ("chase" if delta < 0 else "none")


def prune(variances: torch.Tensor, k_max: int, protected: int = 0) -> list[int]:
    """Kept criterion indices: drop the lowest-variance (oldest on ties) unprotected ones down to k_max."""
    n = variances.numel()
    if n <= k_max:
        return list(range(n))
    cands = list(range(n - protected))
    order = sorted(cands, key=lambda i: (float(variances[i]), i))
    dropped = set(order[: n - k_max])
    return [i for i in range(n) if i not in dropped]


@dataclass
class Rubric:
    """One prompt's rubric: criteria texts and weights, a version (bumped on every change) and, per
    criterion, an EMA of the within-group score variance (how discriminative it is)."""

    criteria: list[str]
    weights: list[float]
    version: int = 0
    variance: list[float] = field(default_factory=list)

    def __post_init__(self):
        if len(self.criteria) != len(self.weights):
            raise ValueError(f"rubric: {len(self.criteria)} criteria but {len(self.weights)} weights")
        if any(w < 0 for w in self.weights):
            raise ValueError("rubric: CARE weights must be >= 0")
        if not self.variance:
            self.variance = [0.0] * len(self.criteria)


async def _judged(
    judge: LLMJudge, prompt: str, criteria: Sequence[str], responses: Sequence[str]
) -> torch.Tensor:
    """[len(responses), len(criteria)] judge scores in [0, 1] (0 where a call fails)."""
    if not criteria:
        return torch.zeros(len(responses), 0, dtype=torch.float64)
    res = await judge.ask_many(
        [
            CRITERION_PROMPT.format(prompt=prompt, criterion=c, response=y)
            for y in responses
            for c in criteria
        ],
        parse_score,
    )
    vals = [x.value if x.error is None else 0.0 for x in res]
    return torch.tensor(vals, dtype=torch.float64).view(len(responses), len(criteria))


@REWARD_SHAPERS.register("care")
class CARE(RoundShaper):
    """Rubric store and evolution step; ``reward`` scores a group with the current rubric version."""

    def __init__(
        self, k_max: int = 12, new_weight: float = 1.0, variance_beta: float = 0.9, evolve: bool = True
    ):
        if k_max < 1:
            raise ValueError(f"care: k_max={k_max} must be >= 1")
        self.k_max, self.new_weight, self.variance_beta, self.evolve_on = (
            k_max,
            new_weight,
            variance_beta,
            evolve,
        )
        self.rubrics: dict[int, Rubric] = {}
        self.anchors: dict[int, str] = {}
        self.events: list[tuple[int, str, bool]] = []  # (prompt uid, branch, accepted)

    def add_prompt(self, uid: int, criteria: Sequence[str], weights: Sequence[float], anchor: str) -> None:
        self.rubrics[uid] = Rubric(list(criteria), list(weights))
        self.anchors[uid] = anchor

    def reward(self, uid: int, scores: torch.Tensor) -> torch.Tensor:
        """Rubric reward of a group's scores [G, K] under the prompt's current rubric; also updates the
        criteria's discrimination statistics."""
        rub = self.rubrics[uid]
        if scores.shape[1] != len(rub.criteria):
            raise ValueError(
                f"care: prompt {uid} has {len(rub.criteria)} criteria, scores have {scores.shape[1]}"
            )
        var = scores.double().var(0, unbiased=False) if scores.shape[0] > 1 else torch.zeros(scores.shape[1])
        b = self.variance_beta
        rub.variance = [b * v + (1 - b) * float(x) for v, x in zip(rub.variance, var)]
        return rubric_reward(scores, torch.tensor(rub.weights))

    async def evolve(
        self,
        uid: int,
        prompt: str,
        responses: Sequence[str],
        scores: torch.Tensor,
        anchor_scores: torch.Tensor,
        judge: LLMJudge,
        evolver: LLMJudge | None = None,
    ) -> str:
        """One evolution step for prompt ``uid`` after its group was scored; returns the branch taken
        (``none`` also when evolution is off or a call failed). Only y⁺ and y* are shown to the LLMs."""
        if not self.evolve_on:
            return "none"
        rub, anchor = self.rubrics[uid], self.anchors[uid]
        w = torch.tensor(rub.weights)
        R = rubric_reward(scores, w)
        best = int(torch.argmax(R))
        r_anchor = float(rubric_reward(anchor_scores.unsqueeze(0), w)[0])
        pref = await judge.ask(
            PREFERENCE_PROMPT.format(prompt=prompt, a=anchor, b=responses[best]), parse_preference
        )
        if pref.error is not None:
            return "none"
        branch = trigger(float(R[best]), r_anchor, pref.value)
        if branch == "none":
            return branch
        rubric_text = "\n".join(f"- {c} (weight {wt})" for c, wt in zip(rub.criteria, rub.weights))
        new = await (evolver or judge).ask(
            EVOLVE_PROMPT[branch].format(
                prompt=prompt, rubric=rubric_text, best=responses[best], anchor=anchor
            ),
            parse_criterion,
        )
        if new.error is not None:
            self.events.append((uid, branch, False))
            return branch
        s_anchor, s_best = await judge.ask_many(
            [
                CRITERION_PROMPT.format(prompt=prompt, criterion=new.value, response=r)
                for r in (anchor, responses[best])
            ],
            parse_score,
        )
        accepted = s_anchor.error is None and s_best.error is None and s_anchor.value > s_best.value
        self.events.append((uid, branch, accepted))
        if accepted:
            rub.criteria.append(new.value)
            rub.weights.append(self.new_weight)
            rub.variance.append(0.0)
            keep = prune(torch.tensor(rub.variance), self.k_max, protected=1)
            rub.criteria = [rub.criteria[i] for i in keep]
            rub.weights = [rub.weights[i] for i in keep]
            rub.variance = [rub.variance[i] for i in keep]
            rub.version += 1
        return branch

    needs_judge = True

    def check_weights(self, weights: dict[str, float]) -> None:
        """The reward weights are the initial rubric's weights: they must be >= 0."""
        if any(w < 0 for w in weights.values()):
            raise ValueError(
                "reward.shaping.name='care': reward.functions weights must be >= 0 (rubric weights)"
            )

    async def shape_round(self, r: RolloutRound, env: Any) -> RoundResult:
        """Each prompt's rubric starts as the reward dimensions (weights as criterion weights); the
        anchor response y* is the ground-truth answer (quickstart stand-in); criteria the evolver
        added are scored by the judge (0 when a call fails)."""
        from megarl.rewards.shaping.processor import dims_matrix

        names = list(r.weights)
        K0 = len(names)
        base = dims_matrix(r)
        out = torch.zeros(len(r.texts), dtype=torch.float64)
        branches: dict[str, int] = {}
        for g, (prompt, answer, uid) in enumerate(zip(r.prompts, r.answers, r.uids)):
            if uid not in self.rubrics:
                self.add_prompt(uid, names, [r.weights[k] for k in names], anchor=answer)
            rub = self.rubrics[uid]
            sl = slice(g * r.n, (g + 1) * r.n)
            texts = r.texts[sl]
            anchor_dims = env.score_anchor(answer)
            extra = rub.criteria[K0:]
            scores = torch.cat([base[sl], await _judged(env.judge, prompt, extra, texts)], 1)
            anchor = torch.cat(
                [
                    torch.tensor([anchor_dims[k] for k in names], dtype=torch.float64),
                    (await _judged(env.judge, prompt, extra, [answer]))[0],
                ]
            )
            out[sl] = self.reward(uid, scores)
            b = await self.evolve(uid, prompt, texts, scores, anchor, env.judge)
            branches[b] = branches.get(b, 0) + 1
        m = {f"shaping/care/branch_{k}": float(v) for k, v in branches.items()}
        m["shaping/care/criteria_mean"] = float(
            sum(len(self.rubrics[u].criteria) for u in r.uids) / len(r.uids)
        )
        return RoundResult(out, metrics=m)

    def state_dict(self) -> dict:
        return {
            "rubrics": {u: vars(r).copy() for u, r in self.rubrics.items()},
            "anchors": dict(self.anchors),
        }

    def load_state_dict(self, state: dict) -> None:
        self.rubrics = {
            u: Rubric(**{k: (list(v) if isinstance(v, list) else v) for k, v in r.items()})
            for u, r in state["rubrics"].items()
        }
        self.anchors = dict(state["anchors"])


SPEC = MethodSpec(
    name="care",
    summary="CARE: per-prompt rubrics evolved with an LLM judge",
    provenance="reconstructed",
    config={"reward": {"shaping": {"name": "care"}}},
)
