"""Shared parts of the reflection/privileged-context methods (SRPO, CRPO, ReflectRL).

- ``context_ids_row``: token ids as a NaN-padded context row (the row format of
  megarl/methods/distillation/self_teacher.py), cut to the row's width;
- ``ContextLogprobs``: a learner pass that fills ``token_extras[name]`` [T] with the policy's own
  logprobs of the batch's tokens when each sequence's context row (``extras[rows]``) is inserted
  after its prompt (``self_teacher_logprobs``: one extra forward, no second model), and
  ``extras[on]`` [B] (1 where the row is non-empty);
- ``token_gap``: ℓ_t = teacher − student on loss tokens of sequences with a context, 0 elsewhere;
- ``turn_index``: each token's assistant-turn index (its k-th ``assistant`` span; the whole
  response is turn 0 in a single-turn batch), -1 elsewhere.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.methods.distillation.self_teacher import self_teacher_logprobs


def context_ids_row(ids: list[int], width: int) -> list[float]:
    """``ids`` (cut to ``width``) as a NaN-padded row of ``width`` floats; [] gives an all-NaN row."""
    ids = list(ids)[:width]
    return [float(t) for t in ids] + [math.nan] * (width - len(ids))


def eos_id(tokenizer: Any) -> int | None:
    """The tokenizer's end-of-sequence id (megarl's char tokenizer or a HF tokenizer)."""
    eos = getattr(tokenizer, "eos_id", None)
    return getattr(tokenizer, "eos_token_id", None) if eos is None else eos


class ContextLogprobs:
    """A ``LearnerPass`` (module docstring): ``rows`` names the extras it reads; ``needs``: the
    round inputs that make them (none when the rollout workflow attaches the rows)."""

    def __init__(self, policy: Any, rows: str, name: str, on: str, needs: tuple[str, ...] = ()):
        self.policy, self.rows, self.name, self.on = policy, rows, name, on
        self.needs_inputs: tuple[str, ...] = needs

    def fill(self, batch: PackedBatch, micro_batches: int) -> dict[str, float]:
        """In place (collective); the fraction of sequences read with a context."""
        if self.rows not in batch.extras:
            raise ValueError(f"{self.name}: the batch carries no '{self.rows}' rows (the {self.rows} input)")
        rows = torch.as_tensor(batch.extras[self.rows], dtype=torch.float64)
        lp, has = self_teacher_logprobs(self.policy, batch, rows, micro_batches, "with_context")
        batch.token_extras[self.name] = lp.double()
        batch.extras[self.on] = has.to(torch.float64)
        return {f"{self.name}/forwarded_frac": float(has.double().mean()) if has.numel() else 0.0}


def token_gap(
    batch: PackedBatch, teacher: torch.Tensor | None, on: torch.Tensor | None, what: str
) -> torch.Tensor:
    """[T] float64 ℓ_t = ``teacher`` − old_logprobs on loss tokens of sequences with ``on`` [B] set
    (None: all), 0 elsewhere; both stop-gradient: the gap is data. ``what`` names the teacher
    input in the error when it or the old logprobs are missing."""
    if teacher is None or batch.old_logprobs is None:
        raise ValueError(f"the estimator needs {what} and the batch field 'old_logprobs'")
    has = torch.ones(batch.num_seqs, dtype=torch.bool) if on is None else torch.as_tensor(on).bool()
    keep = batch.loss_mask.bool() & has.repeat_interleave(batch.seq_lens)
    gap = teacher.detach().double() - batch.old_logprobs.detach().double()
    return torch.where(keep, gap, torch.zeros((), dtype=torch.float64))


def turn_index(batch: PackedBatch) -> torch.Tensor:
    """[T] long: the assistant-turn index of each token (see the module docstring), -1 elsewhere."""
    out = torch.full((batch.num_tokens,), -1, dtype=torch.long)
    for i in range(batch.num_seqs):
        s, e, p = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1]), int(batch.prompt_lens[i])
        if batch.turn_spans is None:
            out[s + p : e] = 0
            continue
        k = 0
        for a, b, role in batch.turn_spans[i]:
            if role == "assistant":
                out[s + a : s + b] = k
                k += 1
    return out
