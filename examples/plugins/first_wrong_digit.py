"""A user's own multi-turn environment and workflow, as a method plugin (docs/agents.md).

On the quickstart's reverse task: a wrong answer gets the observation " C<i>=" (the first wrong
digit is at position i) and another turn, up to ``max_turns``; the episode scores its last answer.

    PYTHONPATH=examples/plugins megarl train examples/plugins/first-wrong-digit.yaml
"""

from __future__ import annotations

from megarl.plugin.spec import MethodSpec
from megarl.rollout.environments import StepResult
from megarl.rollout.workflow import WORKFLOWS, EpisodeWorkflow


class FirstWrongDigit:
    """The environment: token ids in, observation ids, reward and done out."""

    def __init__(self, tok, prompt: str, answer: str, max_turns: int):
        self.tok, self.prompt, self.answer, self.max_turns = tok, prompt, answer, max_turns

    def reset(self, seed=None) -> list[int]:
        self.turn, self.last_text = 0, ""
        return self.tok.encode(self.prompt)

    def step(self, action_ids: list[int]) -> StepResult:
        self.turn += 1
        self.last_text = text = self.tok.decode(action_ids).strip()
        wrong = [i for i, (a, b) in enumerate(zip(text, self.answer)) if a != b]
        if text == self.answer or self.turn >= self.max_turns:
            return StepResult([], float(text == self.answer), True)
        first = wrong[0] if wrong else min(len(text), len(self.answer))
        return StepResult(self.tok.encode(f" C{first}=", bos=False), 0.0, False)


class FirstWrongDigitWorkflow(EpisodeWorkflow):
    """How one prompt becomes ``n`` concurrent episodes: the built-in runner, this environment."""

    def make_env(self, prompt: str, answer: str) -> FirstWrongDigit:
        return FirstWrongDigit(self.ctx.tokenizer, prompt, answer, self.ctx.env.max_turns)


SPEC = MethodSpec(
    name="first_wrong_digit",
    summary="multi-turn reverse task: a wrong answer is told where its first wrong digit is",
    provenance="reconstructed",
    config={"environment": {"name": "first_wrong_digit", "max_turns": 3}},
    register=lambda: WORKFLOWS.add("first_wrong_digit", FirstWrongDigitWorkflow),
)
