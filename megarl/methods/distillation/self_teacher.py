"""The self-teacher: the policy's own weights reading each prompt with a privileged context.

Two batch inputs:

- ``self_teacher_context`` (stage ``round``, rank 0): per sample, the token ids of the context as
  a NaN-padded row (``extras['self_teacher_context']``, an all-NaN row: no context), and the
  correctness that chose it (``extras['self_teacher_correct']``, 1/0). ``source`` says what the
  context holds: ``answer`` (the prompt's reference answer or hint), ``sibling`` (the shortest
  correct rollout of the same group other than the sample itself), ``majority`` (the shortest
  rollout whose extracted answer is the group's majority answer, when its vote share reaches
  ``min_vote``; nothing of the ground truth is read) or ``skill_card`` (the card of the prompt's
  task from the JSONL file ``cards``, withheld where it contains the prompt's answer:
  megarl/methods/distillation/skill_cards.py). ``when`` says which samples get it: ``all``,
  ``incorrect``, ``group_all_wrong`` (every sample of a group with no correct sample) or
  ``longest_incorrect`` (one per group). Correctness is the run's correctness check, or, with
  ``majority``, agreement with the majority answer. The text is ``template`` formatted with
  ``{solution}`` (the chosen text) and ``{answer}`` (the reference answer; refused with
  ``majority``).
- ``self_teacher_logprobs`` [T] (stage ``learner``, every rank): one forward-only pass of the
  policy learner over the privileged batch, ``prompt + context + response`` per sequence
  (megarl.methods.critics.privileged.privileged_batch), mapped back to the batch's token
  positions. No second model: the same learner, one extra forward. ``forward: with_context``
  (default) forwards only the sequences that have a context (the others get 0 and
  ``extras['self_teacher_on'] = 0``); ``forward: all`` forwards every sequence, so a sequence
  without a context gets exactly the policy's own logprobs.
- ``self_teacher_logits`` (same provider, when a part asks for it): a second forward of the same
  privileged batch keeps this rank's vocab shard of the self-teacher's aligned logits, mapped to
  the batch's tokens, in ``token_extras['teacher_logits']`` [T, V/tp] (the slot the objective hands
  to full-vocabulary parts as ``LossContext.teacher_logits``; refused when a teacher's logits are
  already there).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.methods.critics.privileged import context_row, privileged_batch
from megarl.methods.distillation.solution_mixture import (
    BLOCKS,
    choose_context_sets,
    mixture_logits,
    mixture_logprobs,
)
from megarl.plugin.inputs import InputProvider, register_provider
from megarl.plugin.knobs import Knobs
from megarl.plugin.rounds import RolloutRound, RoundResult

CONTEXT = "self_teacher_context"
CORRECT = "self_teacher_correct"
ON = "self_teacher_on"
LOGPROBS = "self_teacher_logprobs"
LOGITS = "self_teacher_logits"
SOURCES = ("answer", "sibling", "majority", "skill_card")
WHEN = ("all", "incorrect", "group_all_wrong", "longest_incorrect")


@dataclass
class ContextKnobs(Knobs):
    """See the module docstring. answer_pattern: a regex whose group 1 (else the whole match) is a
    response's answer for the majority vote (empty: the stripped response); min_vote: the vote
    share the majority answer needs; max_tokens: the longest context (its row width); solutions:
    how many verified solutions a chosen sample reads in turn, the teacher being their mixture
    (sibling / majority sources; megarl/methods/distillation/solution_mixture.py)."""

    source: str = "answer"
    template: str = "{solution}"
    when: str = "all"
    max_tokens: int = 64
    answer_pattern: str = ""
    min_vote: float = 0.5
    cards: str = ""
    solutions: int = 1

    def check(self) -> None:
        """Names, ranges, a template that formats with ``solution``/``answer`` only, a valid regex."""
        if self.source not in SOURCES:
            raise ValueError(f"source={self.source!r}; known: {', '.join(SOURCES)}")
        if self.when not in WHEN:
            raise ValueError(f"when={self.when!r}; known: {', '.join(WHEN)}")
        try:
            self.template.format(solution="", answer="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"template={self.template!r} must format with {{solution}} and {{answer}} only ({e})"
            ) from None
        if self.source == "majority" and "{answer}" in self.template:
            raise ValueError("template: source=majority reads no ground truth, so {answer} is refused")
        if self.source == "skill_card" and "{answer}" in self.template:
            raise ValueError("template: source=skill_card shows an answer-free card, so {answer} is refused")
        if self.solutions < 1 or (self.solutions > 1 and self.source not in ("sibling", "majority")):
            raise ValueError(
                f"solutions={self.solutions}: >= 1, and > 1 only with source sibling or majority"
            )
        if (self.source == "skill_card") != bool(self.cards):
            raise ValueError("cards (a JSONL file of task cards) is set exactly when source=skill_card")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if not 0.0 <= self.min_vote <= 1.0:
            raise ValueError(f"min_vote={self.min_vote} must be in [0, 1]")
        try:
            re.compile(self.answer_pattern)
        except re.error as e:
            raise ValueError(f"answer_pattern={self.answer_pattern!r} is not a regex ({e})") from None


def extract_answer(text: str, pattern: str) -> str | None:
    """A response's answer: group 1 (else the whole match) of ``pattern``'s first match, None when
    it does not match; with an empty pattern the stripped text."""
    if not pattern:
        return text.strip()
    m = re.search(pattern, text)
    if m is None:
        return None
    return m.group(1) if m.groups() else m.group(0)


def majority_vote(answers: list[str | None], min_vote: float) -> tuple[list[bool], bool]:
    """(agrees with the majority answer, per sample; whether the vote share reaches ``min_vote``).
    Ties between answers go to the one seen first; unparsed answers (None) never agree."""
    counts: dict[str, int] = {}
    for a in answers:
        if a is not None:
            counts[a] = counts.get(a, 0) + 1
    if not counts:
        return [False] * len(answers), False
    top = max(counts.values())
    mode = next(a for a in answers if a is not None and counts[a] == top)
    return [a == mode for a in answers], top / len(answers) >= min_vote


def choose_contexts(
    lengths: list[int], correct: list[bool], source: str, when: str, usable: bool = True
) -> list[int | None]:
    """For one group: the index of the sample whose text is each sample's context (None: none).

    ``lengths``: response lengths; ``correct``: verdicts (or majority agreement); ``usable``: False
    drops every context of the group (a majority vote under ``min_vote``). ``answer`` gives -1
    (the reference answer) to every chosen sample."""
    n = len(lengths)
    ok = [i for i in range(n) if correct[i]]
    if when == "all":
        chosen = set(range(n))
    elif when == "incorrect":
        chosen = {i for i in range(n) if not correct[i]}
    elif when == "group_all_wrong":
        chosen = set(range(n)) if not ok else set()
    else:  # longest_incorrect: ties go to the lowest index
        wrong = [i for i in range(n) if not correct[i]]
        chosen = {max(wrong, key=lambda i: (lengths[i], -i))} if wrong else set()
    out: list[int | None] = [None] * n
    if not usable:
        return out
    for i in sorted(chosen):
        if source == "answer":
            out[i] = -1
            continue
        others = [j for j in ok if j != i] if source == "sibling" else ok
        if others:
            out[i] = min(others, key=lambda j: (lengths[j], j))
    return out


class SelfTeacherContext:
    """A ``RoundProcessor``: the context rows and the correctness of the round's samples. Stateless."""

    def __init__(self, tokenizer: Any, knobs: ContextKnobs, dataset: Any = None):
        self.tokenizer, self.knobs = tokenizer, knobs
        self.cards = None
        if knobs.source == "skill_card":
            from megarl.methods.distillation.skill_cards import CardTexts, read_cards

            self.cards = CardTexts(read_cards(knobs.cards), dataset)

    def _correct(self, r: RolloutRound) -> tuple[list[bool], list[bool]]:
        """Per-sample correctness and, per group, whether its contexts may be used."""
        k = self.knobs
        if k.source == "majority":
            correct, usable = [], []
            for g in range(len(r.prompts)):
                texts = r.texts[g * r.n : (g + 1) * r.n]
                agree, ok = majority_vote([extract_answer(t, k.answer_pattern) for t in texts], k.min_vote)
                correct += agree
                usable.append(ok)
            return correct, usable
        if r.correct is None:
            raise ValueError(
                f"inputs.{CONTEXT}: source={k.source!r} needs the run's correctness check (mark the "
                "verifier with reward.functions[i].correct: true)"
            )
        return [bool(c) for c in r.correct.tolist()], [True] * len(r.prompts)

    async def process(self, r: RolloutRound) -> RoundResult:
        """The rows of the round (one per sample) and the correctness that chose them."""
        k = self.knobs
        correct, usable = self._correct(r)
        cards = self.cards.of_round(r) if self.cards is not None else None
        rows: list[list[float]] = []
        used = 0
        for g in range(len(r.prompts)):
            sl = slice(g * r.n, (g + 1) * r.n)
            lengths = [len(x) for x in r.response_ids[sl]]
            ok = usable[g] and (cards is None or cards[g] is not None)
            source = "answer" if cards is not None else k.source  # a card: one text for the prompt
            if k.solutions > 1:
                sets = choose_context_sets(lengths, correct[sl], source, k.when, ok, k.solutions)
            else:
                sets = [
                    [] if p is None else [p]
                    for p in choose_contexts(lengths, correct[sl], source, k.when, ok)
                ]
            for j, picks in enumerate(sets):
                row: list[float] = []
                for pick in picks:
                    if cards is not None:
                        solution = cards[g]
                    else:
                        solution = r.answers[g] if pick == -1 else r.texts[g * r.n + pick]
                    answer = "" if k.source in ("majority", "skill_card") else r.answers[g]
                    text = k.template.format(solution=solution, answer=answer)
                    where = f"inputs.{CONTEXT}: the context of sample {j} of prompt {r.uids[g]}"
                    row += context_row(self.tokenizer, text, k.max_tokens, where)
                rows.append(row + [math.nan] * (k.max_tokens * k.solutions - len(row)))
                used += bool(picks)
        lens = [sum(not math.isnan(x) for x in row) for row in rows]
        on = [x for x in lens if x]
        extras = {CONTEXT: rows, CORRECT: [float(c) for c in correct]}
        if k.solutions > 1:
            extras[BLOCKS] = [float(k.solutions)] * len(rows)
        return RoundResult(
            extras=extras,
            metrics={
                "self_teacher/context_frac": used / max(len(rows), 1),
                "self_teacher/context_len": sum(on) / max(len(on), 1),
            },
        )

    def state_dict(self) -> dict:
        """Nothing to save."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore."""


@dataclass
class TeacherKnobs(Knobs):
    """forward: with_context (only the sequences that have a context) | all."""

    forward: str = "with_context"

    def check(self) -> None:
        """A known mode."""
        if self.forward not in ("with_context", "all"):
            raise ValueError(f"forward={self.forward!r}; known: with_context, all")


def context_rows(batch: PackedBatch) -> torch.Tensor:
    """``batch.extras['self_teacher_context']`` [B, K] (an error says how to get it)."""
    rows = batch.extras.get(CONTEXT)
    if rows is None:
        raise ValueError(
            f"{LOGPROBS}: the batch carries no '{CONTEXT}' rows (the {CONTEXT} round input fills them)"
        )
    return torch.as_tensor(rows, dtype=torch.float64)


def _privileged(batch: PackedBatch, rows: torch.Tensor, forward: str):
    """(forwarded sequences [B] bool, the privileged batch of those or None, index of their
    tokens in it, their token positions in ``batch``)."""
    has = (
        ~torch.isnan(rows).all(1)
        if forward == "with_context"
        else torch.ones(batch.num_seqs, dtype=torch.bool)
    )
    ids = has.nonzero()[:, 0]
    if ids.numel() == 0:
        return has, None, None, None
    sub = batch if forward == "all" else batch.select(ids)
    seen, index = privileged_batch(sub, rows[ids])
    tok = torch.cat(
        [torch.arange(int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])) for i in ids.tolist()]
    )
    return has, seen, index, tok


def self_teacher_logprobs(
    policy: Any, batch: PackedBatch, rows: torch.Tensor, micro_batches: int, forward: str = "with_context"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [T] of the batch's tokens under ``policy`` with each sequence's context row
    inserted after its prompt, which sequences were forwarded [B] bool). ``policy``: anything
    with ``compute_logprobs(batch, micro_batches) -> (logprobs [T], _)`` (collective)."""
    has, seen, index, tok = _privileged(batch, rows, forward)
    out = torch.zeros(batch.num_tokens, dtype=torch.float32)
    if seen is None:
        return out, has
    lp, _ = policy.compute_logprobs(seen, max(1, min(micro_batches, seen.num_seqs)))
    out[tok] = lp[index].float()
    return out, has


def self_teacher_logits(
    policy: Any, batch: PackedBatch, rows: torch.Tensor, micro_batches: int, forward: str = "with_context"
) -> torch.Tensor | None:
    """This rank's vocab shard of the self-teacher's aligned logits at the batch's tokens
    ``[T, V/tp]`` (zeros on sequences not forwarded), on the last pipeline stage; None elsewhere or
    when nothing is forwarded. ``policy``: ``compute_logits(batch, micro_batches)`` (collective)."""
    _, seen, index, tok = _privileged(batch, rows, forward)
    if seen is None:
        return None
    logits = policy.compute_logits(seen, max(1, min(micro_batches, seen.num_seqs)))
    if logits is None:
        return None
    out = logits.new_zeros((batch.num_tokens, logits.shape[-1]))
    out[tok.to(logits.device)] = logits[index.to(logits.device)]
    return out


class SelfTeacher:
    """The ``self_teacher_logprobs`` / ``self_teacher_logits`` learner pass (module docstring)."""

    def __init__(self, policy: Any, knobs: TeacherKnobs, names: frozenset = frozenset({LOGPROBS})):
        self.policy, self.knobs, self.names = policy, knobs, names
        self.needs_inputs: tuple[str, ...] = (CONTEXT,)  # the round input it reads

    @staticmethod
    def _check_logits_slot(batch: PackedBatch) -> None:
        if "teacher_logits" in batch.token_extras:
            raise ValueError(
                f"{LOGITS}: the batch already carries a teacher's logits "
                "(token_extras['teacher_logits']); a run distils from one full-vocabulary teacher"
            )

    def fill(self, batch: PackedBatch, micro_batches: int) -> dict[str, float]:
        """In place (collective); the fraction of sequences forwarded with a context."""
        rows = context_rows(batch)
        m = int(batch.extras[BLOCKS][0]) if BLOCKS in batch.extras and batch.num_seqs else 1
        if (
            m > 1
        ):  # several solutions per target: their mixture (megarl/methods/distillation/solution_mixture.py)
            if self.knobs.forward != "with_context":
                raise ValueError(
                    f"inputs.{CONTEXT}.solutions={m}: the mixture teacher needs forward: with_context"
                )

            def one(b, block, micro):
                return self_teacher_logprobs(self.policy, b, block, micro, "with_context")

            lp, count = mixture_logprobs(one, batch, rows, m, micro_batches)
            has = count > 0
            batch.self_teacher_logprobs = lp
            batch.extras[ON] = has.to(torch.float64)
            if LOGITS in self.names:
                self._check_logits_slot(batch)
                g = getattr(self.policy, "groups", None)
                tp = g.tp if g is not None and g.layout.tp > 1 else None

                def block_logits(b, block, micro):
                    return self_teacher_logits(self.policy, b, block, micro, "with_context")

                mix = mixture_logits(block_logits, batch, rows, m, micro_batches, tp)
                if mix is not None:
                    batch.token_extras["teacher_logits"] = mix
            return {
                "self_teacher/forwarded_frac": float(has.double().mean()) if has.numel() else 0.0,
                "self_teacher/solutions_mean": float(count[has].double().mean()) if bool(has.any()) else 0.0,
            }
        lp, has = self_teacher_logprobs(self.policy, batch, rows, micro_batches, self.knobs.forward)
        batch.self_teacher_logprobs = lp
        batch.extras[ON] = has.to(torch.float64)
        if LOGITS in self.names:
            self._check_logits_slot(batch)
            logits = self_teacher_logits(self.policy, batch, rows, micro_batches, self.knobs.forward)
            if logits is not None:
                batch.token_extras["teacher_logits"] = logits
        return {"self_teacher/forwarded_frac": float(has.double().mean()) if has.numel() else 0.0}


SELF_TEACHER_CONTEXT = register_provider(
    InputProvider(
        (CONTEXT, CORRECT),
        "round",
        lambda ctx, names: SelfTeacherContext(ctx.tokenizer, ctx.knobs, ctx.dataset),
        knobs=ContextKnobs,
        summary="per-sample privileged context of the self-teacher (reference answer, a correct sibling, "
        "a majority-vote solution, a skill card) and the correctness that chose it",
    )
)
SELF_TEACHER = register_provider(
    InputProvider(
        (LOGPROBS, LOGITS),
        "learner",
        lambda ctx, names: SelfTeacher(ctx.policy, ctx.knobs, frozenset(names)),
        knobs=TeacherKnobs,
        summary="the policy's own logprobs with a privileged context after the prompt (one extra forward)",
    )
)
