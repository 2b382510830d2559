"""A bank of verified successful experience as privileged information (PI), and the policy's
logprobs with it in context.

Two batch inputs:

- ``pi_context`` (stage ``round``, rank 0): a ``PIBank`` round processor. Per prompt (its dataset
  uid) the bank keeps the token ids of the shortest verified successful trajectory seen so far
  (everything the episode appended after the prompt: moves, tool calls, observations; success is
  the run's correctness check). Each sample's context is the shortest success of its prompt among
  the bank's entry from earlier rounds and this round's *other* successful samples (never its
  own trajectory), after ``prefix``; ``extras['pi_context']`` holds it as a NaN-padded row of
  ``max_tokens`` (all-NaN: the prompt has no success yet). Then the round's successes update the
  bank. The bank is bounded (``capacity`` prompts, least recently used dropped first) and its
  entries go in run checkpoints (restored on resume). A success longer than the row is not stored.
- ``pi_logprobs`` (stage ``learner``, every rank): the policy's logprobs of the batch's tokens with
  the sample's PI row after the prompt (one forward of the same learner over the sequences that
  have one), in ``token_extras['pi_logprobs']``; ``extras['pi_on']`` marks those sequences.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from megarl.methods.agents.context_pass import ContextLogprobs
from megarl.methods.critics.privileged import context_row
from megarl.plugin.inputs import InputProvider, register_provider
from megarl.plugin.knobs import Knobs
from megarl.plugin.rounds import RolloutRound, RoundResult

CONTEXT = "pi_context"
LOGPROBS = "pi_logprobs"
ON = "pi_on"


@dataclass
class PIBankKnobs(Knobs):
    """capacity: prompts the bank keeps; max_tokens: the row width (prefix + trajectory);
    prefix: text before the trajectory's token ids."""

    capacity: int = 1024
    max_tokens: int = 64
    prefix: str = ""

    def check(self) -> None:
        """Positive sizes."""
        if self.capacity < 1:
            raise ValueError(f"capacity={self.capacity} must be >= 1")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")


def pick_context(
    banked: list[int] | None, successes: dict[int, list[int]], j: int
) -> tuple[list[int] | None, bool]:
    """(the shortest of ``banked`` and the successes other than sample ``j``, whether it is the
    banked one). Ties go to the banked entry, then to the lowest sample index."""
    best, from_bank = banked, banked is not None
    for i in sorted(successes):
        if i != j and (best is None or len(successes[i]) < len(best)):
            best, from_bank = successes[i], False
    return best, from_bank


class PIBank:
    """The ``pi_context`` round processor (module docstring); its entries are its state."""

    def __init__(self, tokenizer: Any, knobs: PIBankKnobs):
        self.knobs = knobs
        width = knobs.max_tokens
        prefix = context_row(tokenizer, knobs.prefix, width, f"inputs.{CONTEXT}.prefix")
        self.prefix = [int(x) for x in prefix if not math.isnan(x)]
        self.entries: OrderedDict[int, list[int]] = OrderedDict()

    def _row(self, ids: list[int] | None) -> list[float]:
        if ids is None:
            return [math.nan] * self.knobs.max_tokens
        row = [float(t) for t in self.prefix + ids]
        return row + [math.nan] * (self.knobs.max_tokens - len(row))

    def _store(self, uid: int, ids: list[int]) -> None:
        old = self.entries.get(uid)
        if old is None or len(ids) < len(old):
            self.entries[uid] = list(ids)
        self.entries.move_to_end(uid)
        while len(self.entries) > self.knobs.capacity:
            self.entries.popitem(last=False)

    async def process(self, r: RolloutRound) -> RoundResult:
        """Each sample's PI row, then the round's successes into the bank."""
        if r.correct is None:
            raise ValueError(
                f"inputs.{CONTEXT}: the PI bank keeps verified successes and needs the run's correctness "
                "check (mark the verifier with reward.functions[i].correct: true)"
            )
        room = self.knobs.max_tokens - len(self.prefix)
        rows: list[list[float]] = []
        used = banked = too_long = 0
        for g, uid in enumerate(r.uids):
            sl = range(g * r.n, (g + 1) * r.n)
            ok = {j: list(r.response_ids[s]) for j, s in enumerate(sl) if bool(r.correct[s])}
            fits = {j: ids for j, ids in ok.items() if len(ids) <= room}
            too_long += len(ok) - len(fits)
            for j in range(r.n):
                ids, from_bank = pick_context(self.entries.get(uid), fits, j)
                rows.append(self._row(ids))
                used += ids is not None
                banked += from_bank
            if uid in self.entries:
                self.entries.move_to_end(uid)
            for j in sorted(fits, key=lambda j: (len(fits[j]), j))[:1]:
                self._store(uid, fits[j])
        total = max(len(rows), 1)
        return RoundResult(
            extras={CONTEXT: rows},
            metrics={
                "pi_bank/size": float(len(self.entries)),
                "pi_bank/context_frac": used / total,
                "pi_bank/from_bank_frac": banked / total,
                "pi_bank/too_long": float(too_long),
            },
        )

    def state_dict(self) -> dict:
        """The entries, least recently used first."""
        return {"entries": [[uid, list(ids)] for uid, ids in self.entries.items()]}

    def load_state_dict(self, state: dict) -> None:
        """Restore the entries (their order is the recency order)."""
        self.entries = OrderedDict((int(uid), [int(t) for t in ids]) for uid, ids in state.get("entries", []))


PI_CONTEXT = register_provider(
    InputProvider(
        (CONTEXT,),
        "round",
        lambda ctx, names: PIBank(ctx.tokenizer, ctx.knobs),
        knobs=PIBankKnobs,
        summary="per-sample privileged information: the shortest verified successful trajectory of the "
        "same prompt from a bounded, checkpointed bank (never the sample's own)",
    )
)
PI_LOGPROBS = register_provider(
    InputProvider(
        (LOGPROBS,),
        "learner",
        lambda ctx, names: ContextLogprobs(ctx.policy, CONTEXT, LOGPROBS, ON),
        summary="the policy's own logprobs with the PI bank's trajectory after the prompt (an extra forward)",
    )
)
