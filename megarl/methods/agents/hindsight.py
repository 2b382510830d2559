"""Hindsight context: each trajectory's own realised outcome as privileged context, and the
policy's logprobs with it.

Two batch inputs:

- ``hindsight_context`` (stage ``round``, rank 0): per sample, ``template`` formatted with
  ``{outcome}`` (what the run's rewards scored at the end of the episode: the final answer, the
  final cell of a game) and ``{verdict}`` (``success`` / ``failure`` text by the run's correctness
  check), as a NaN-padded row of ``max_tokens`` token ids in ``extras['hindsight_context']``.
- ``hindsight_logprobs`` (stage ``learner``, every rank): the policy's logprobs of the batch's tokens
  with that row after the prompt (one forward of the same learner), in
  ``token_extras['hindsight_logprobs']``; ``extras['hindsight_on']`` marks the sequences read with
  a context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megarl.methods.agents.context_pass import ContextLogprobs
from megarl.methods.critics.privileged import context_row
from megarl.plugin.inputs import InputProvider, register_provider
from megarl.plugin.knobs import Knobs
from megarl.plugin.rounds import RolloutRound, RoundResult

CONTEXT = "hindsight_context"
LOGPROBS = "hindsight_logprobs"
ON = "hindsight_on"


@dataclass
class HindsightKnobs(Knobs):
    """template: the context text (``{outcome}``, ``{verdict}``); success / failure: the verdict's
    text; max_tokens: the row width."""

    template: str = "{verdict}{outcome}="
    success: str = "1"
    failure: str = "0"
    max_tokens: int = 64

    def check(self) -> None:
        """A template that formats with ``outcome`` and ``verdict`` only; a positive width."""
        try:
            self.template.format(outcome="", verdict="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"template={self.template!r} must format with {{outcome}} and {{verdict}} only ({e})"
            ) from None
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")


def hindsight_text(knobs: HindsightKnobs, outcome: str, correct: bool | None) -> str:
    """The hindsight context of one trajectory (the outcome's last ``max_tokens`` characters)."""
    verdict = "" if correct is None else (knobs.success if correct else knobs.failure)
    return knobs.template.format(outcome=outcome[-knobs.max_tokens :], verdict=verdict)


class HindsightContext:
    """The ``hindsight_context`` round processor (module docstring). Stateless."""

    def __init__(self, tokenizer: Any, knobs: HindsightKnobs):
        self.tokenizer, self.knobs = tokenizer, knobs

    async def process(self, r: RolloutRound) -> RoundResult:
        """One row per sample: its own outcome and verdict."""
        if r.correct is None and "{verdict}" in self.knobs.template:
            raise ValueError(
                f"inputs.{CONTEXT}: the template's {{verdict}} needs the run's correctness check "
                "(mark the verifier with reward.functions[i].correct: true)"
            )
        rows = []
        for i, text in enumerate(r.texts):
            correct = None if r.correct is None else bool(r.correct[i])
            where = f"inputs.{CONTEXT}: the context of sample {i % r.n} of prompt {r.uids[i // r.n]}"
            text = hindsight_text(self.knobs, text, correct)
            rows.append(context_row(self.tokenizer, text, self.knobs.max_tokens, where))
        return RoundResult(extras={CONTEXT: rows})

    def state_dict(self) -> dict:
        """Nothing to save."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore."""


HINDSIGHT_CONTEXT = register_provider(
    InputProvider(
        (CONTEXT,),
        "round",
        lambda ctx, names: HindsightContext(ctx.tokenizer, ctx.knobs),
        knobs=HindsightKnobs,
        summary="per-sample hindsight context: the trajectory's own realised outcome and verdict",
    )
)
HINDSIGHT_LOGPROBS = register_provider(
    InputProvider(
        (LOGPROBS,),
        "learner",
        lambda ctx, names: ContextLogprobs(ctx.policy, CONTEXT, LOGPROBS, ON),
        summary="the policy's own logprobs with its trajectory's outcome after the prompt (an extra forward)",
    )
)
