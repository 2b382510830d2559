"""Batch-input providers of the credit family: ``steps`` (GiGPO, PGPO) and ``answer_checkpoints`` (DASH).

- ``steps``: ``turn_spans`` and ``extras["step_state_keys"]`` [B, S]. A single-turn batch gets one
  prompt span and one assistant span per sequence, so every response is one step whose anchor
  state is its prompt.
- ``answer_checkpoints``: ``extras["dash_ends"]``, ``extras["dash_correct"]`` [B, K] from the
  decoded response tokens: every match of ``inputs.answer_checkpoints.pattern`` (a regex whose first
  group is the committed answer) is a commitment, correct when it equals the ground truth.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.methods.credit.dash import answer_checkpoints, checkpoints_to_extras
from megarl.methods.credit.steps import anchor_state_keys
from megarl.plugin.inputs import InputProvider, RolloutInfo, register_provider
from megarl.plugin.knobs import Knobs


def single_turn_spans(batch: PackedBatch) -> list[list[tuple[int, int, str]]]:
    """One ``prompt`` span and one ``assistant`` span (the response) per sequence."""
    lens, plens = batch.seq_lens.tolist(), batch.prompt_lens.tolist()
    return [
        [(0, p, "prompt"), (p, n, "assistant")] if n > p else [(0, p, "prompt")] for p, n in zip(plens, lens)
    ]


class StepsFiller:
    """Fills ``turn_spans`` (when absent) and ``extras["step_state_keys"]``."""

    def fill(self, batch: PackedBatch, info: RolloutInfo) -> dict[str, float]:
        """In place; returns the mean number of steps per sequence."""
        if batch.turn_spans is None:
            batch.turn_spans = single_turn_spans(batch)
        keys = anchor_state_keys(batch)
        batch.extras["step_state_keys"] = keys
        return {"adv/steps_per_seq": float((keys >= 0).sum(1).double().mean())}


@dataclass
class AnswerCheckpointKnobs(Knobs):
    """``pattern``: what counts as an answer commitment (group 1 is the answer; default ``\\boxed{...}``)."""

    pattern: str = r"\\boxed\{([^{}]*)\}"

    def check(self) -> None:
        """The pattern must compile."""
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"pattern={self.pattern!r} is not a regex: {e}") from None


def dash_checkpoint_extras(
    batch: PackedBatch, tokenizer: Any, answers: Sequence[str], pattern: str
) -> dict[str, torch.Tensor]:
    """``dash_ends`` / ``dash_correct`` [B, K] from each response's decoded tokens."""
    cps = []
    for i in range(batch.num_seqs):
        s, e, p = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1]), int(batch.prompt_lens[i])
        pieces = [tokenizer.decode([t]) for t in batch.tokens[s + p : e].tolist()]
        cps.append(answer_checkpoints(pieces, p, answers[i], pattern))
    return checkpoints_to_extras(cps)


class AnswerCheckpointsFiller:
    """Fills DASH's answer-commitment extras (the tokenizer decodes each response token)."""

    def __init__(self, tokenizer: Any, knobs: AnswerCheckpointKnobs):
        self.tok, self.pattern = tokenizer, knobs.pattern

    def fill(self, batch: PackedBatch, info: RolloutInfo) -> dict[str, float]:
        """In place; returns the mean number of checkpoints per sequence."""
        batch.extras.update(dash_checkpoint_extras(batch, self.tok, info.answers, self.pattern))
        return {
            "adv/dash_checkpoints_per_seq": float((batch.extras["dash_ends"] >= 0).sum(1).double().mean())
        }


register_provider(
    InputProvider(
        ("steps",),
        "batch",
        lambda ctx, names: StepsFiller(),
        summary="turn spans and anchor-state keys per step",
    )
)
register_provider(
    InputProvider(
        ("answer_checkpoints",),
        "batch",
        lambda ctx, names: AnswerCheckpointsFiller(ctx.tokenizer, ctx.knobs),
        knobs=AnswerCheckpointKnobs,
        summary="intermediate answer commitments",
        moved_from=(("credit.answer_pattern", "pattern"),),  # the config's `credit` section, removed
    )
)
