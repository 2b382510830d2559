"""Skill cards: an abstract, answer-free description of how to solve a task, read by the policy
as privileged context (the self-teacher, megarl/methods/distillation/self_teacher.py, ``source:
skill_card``), and the measured accuracy of rollouts that read it (SKALD's teacher-advantage gate).

Reconstructed (the SKALD abstract: the same base model viewed with an abstract, answer-filtered
"skill card" is the teacher; the gate distils only where verified rollouts show a teacher
advantage). Choices of this reconstruction:

- cards come from a JSONL file, one card per task (``{"task": ..., "card": ...}``; task ``*``: every
  task without its own card): a card describes a task, never one prompt (the abstraction);
- the explicit-answer filter: a card is not shown with a prompt whose reference answer (stripped,
  non-empty) occurs in the card's text; that prompt's samples get no context;
- the teacher's accuracy on a prompt is measured from ``samples`` rollouts of the current policy
  reading the prompt followed by its card (the context is inserted after the prompt, as the
  self-teacher's forward does), scored by the run's reward: the fraction above
  ``correct_threshold``. Every sample of the prompt carries it in ``extras['teacher_acc']``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.plugin.rounds import RolloutRound, RoundResult

ANY_TASK = "*"
SKILL_ROUND = 2000  # the sampling round index of card-reading rollouts (seeds apart from rollouts)


def read_cards(path: str | Path) -> dict[str, str]:
    """task -> card text from a JSONL file of ``{"task": str, "card": str}`` rows (errors name the
    file and line)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"skill cards: {p} is not a file")
    cards: dict[str, str] = {}
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"skill cards: {p} line {n}: not JSON ({e})") from None
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("task"), str)
            or not isinstance(row.get("card"), str)
        ):
            raise ValueError(f"skill cards: {p} line {n}: expected {{'task': str, 'card': str}}, got {row!r}")
        if row["task"] in cards:
            raise ValueError(f"skill cards: {p} line {n}: task {row['task']!r} has a card already")
        cards[row["task"]] = row["card"]
    if not cards:
        raise ValueError(f"skill cards: {p} has no card")
    return cards


def card_for(cards: dict[str, str], task: str, answer: str) -> str | None:
    """The card shown with a prompt of ``task`` whose reference answer is ``answer``: the task's
    card (else the ``*`` card), None when there is none or the answer occurs in it (the filter)."""
    card = cards.get(task, cards.get(ANY_TASK))
    if card is None:
        return None
    a = answer.strip()
    if a and a in card:
        return None
    return card


def accuracy_per_prompt(scores: list[float], counts: list[int], threshold: float) -> list[float]:
    """The fraction of each prompt's rollouts (``counts[i]`` consecutive ``scores``) above
    ``threshold`` (0 for a prompt without rollouts)."""
    out, k = [], 0
    for n in counts:
        out.append(sum(v > threshold for v in scores[k : k + n]) / n if n else 0.0)
        k += n
    return out


@dataclass
class CardTexts:
    """The card text of each prompt of a round (None: no card, or filtered), from the run's dataset
    (``uids`` are dataset rows: their ``task``)."""

    cards: dict[str, str]
    dataset: Any

    def of_round(self, r: RolloutRound) -> list[str | None]:
        """One card (or None) per prompt of ``r``."""
        rows = self.dataset.rows
        return [card_for(self.cards, rows[u].task, a) for u, a in zip(r.uids, r.answers)]


class CardAccuracy:
    """A ``RoundProcessor`` (rank 0): per prompt with a card, ``samples`` rollouts of the policy
    reading ``prompt + template(card)`` on the run's engine, scored; ``extras['teacher_acc']`` of
    every sample of the prompt is their accuracy (0 without a card: the gate stays closed)."""

    def __init__(self, ctx: Any, texts: CardTexts, template: str, samples: int, correct_threshold: float):
        self.ctx, self.texts, self.template = ctx, texts, template
        self.samples, self.threshold = samples, correct_threshold

    async def process(self, r: RolloutRound) -> RoundResult:
        """The teacher accuracy of each prompt, per sample."""
        ctx, tok = self.ctx, self.ctx.tokenizer
        cards = self.texts.of_round(r)
        todo = [g for g, c in enumerate(cards) if c is not None]
        reqs = [
            ctx.engine.generate(
                list(r.prompt_ids[g])
                + tok.encode(self.template.format(solution=cards[g], answer=""), bos=False),
                n=self.samples,
                sampling=ctx.sampling(r.step, SKILL_ROUND + r.round, g),
            )
            for g in todo
        ]
        results = await asyncio.gather(*reqs)
        texts = [tok.decode(list(s.token_ids)) for res in results for s in res.samples]
        answers = [r.answers[g] for g, res in zip(todo, results) for _ in res.samples]
        scores = (await asyncio.to_thread(ctx.score, texts, answers)).scalar.tolist() if texts else []
        acc = [0.0] * len(r.prompts)
        for g, a in zip(todo, accuracy_per_prompt(scores, [len(x.samples) for x in results], self.threshold)):
            acc[g] = a
        per_sample = [acc[g] for g in range(len(r.prompts)) for _ in range(r.n)]
        return RoundResult(
            extras={"teacher_acc": per_sample},
            metrics={
                "skill_card/prompts_with_card": len(todo) / max(len(r.prompts), 1),
                "skill_card/teacher_acc": sum(acc[g] for g in todo) / max(len(todo), 1),
                "skill_card/rollouts": float(len(texts)),
            },
        )

    def state_dict(self) -> dict:
        """Nothing: the rollouts are functions of the round and the seed."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore."""
