"""Shared parts of the reflection/privileged-context methods (SRPO, CRPO, ReflectRL).

- ``context_ids_row``: token ids as a NaN-padded context row (the row format of
  megarl/methods/distillation/self_teacher.py), cut to the row's width;
- ``token_gap``: ℓ_t = teacher − student on loss tokens of sequences with a context, 0 elsewhere;
- ``turn_index``: each token's assistant-turn index (its k-th ``assistant`` span; the whole
  response is turn 0 in a single-turn batch), -1 elsewhere.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megarl.batch import PackedBatch


def context_ids_row(ids: list[int], width: int) -> list[float]:
    """``ids`` (cut to ``width``) as a NaN-padded row of ``width`` floats; [] gives an all-NaN row."""
    ids = list(ids)[:width]
    return [float(t) for t in ids] + [math.nan] * (width - len(ids))


def eos_id(tokenizer: Any) -> int | None:
    """The tokenizer's end-of-sequence id (megarl's char tokenizer or a HF tokenizer)."""
    eos = getattr(tokenizer, "eos_id", None)
    return getattr(tokenizer, "eos_token_id", None) if eos is None else eos


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
