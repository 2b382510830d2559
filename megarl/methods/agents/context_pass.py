"""A learner pass: the policy's own logprobs of the batch's tokens with a per-sample context row
inserted after the prompt (one forward-only pass of the same learner over the sequences that have
a context; megarl.methods.distillation.self_teacher.self_teacher_logprobs).

The rows come from a round input or the rollout workflow (``batch.extras[rows]``, NaN-padded token
ids, an all-NaN row: no context); the logprobs go to ``batch.token_extras[out]`` [T] (0 on sequences
without a context, which ``batch.extras[on]`` [B] marks 0), so they travel with their tokens through
micro-batch and data-parallel splits. ``ContextTeacher`` (context_teacher.py) is the same pass
writing ``batch.self_teacher_logprobs`` instead.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.methods.distillation.self_teacher import self_teacher_logprobs


def rows_of(batch: PackedBatch, key: str, needed_by: str) -> torch.Tensor:
    """``batch.extras[key]`` as [B, K] float64 rows (an error names who needs them)."""
    rows = batch.extras.get(key)
    if rows is None:
        raise ValueError(f"{needed_by}: the batch carries no '{key}' rows (extras['{key}'])")
    rows = torch.as_tensor(rows, dtype=torch.float64)
    if rows.dim() != 2 or rows.shape[0] != batch.num_seqs:
        raise ValueError(
            f"{needed_by}: extras['{key}'] has shape {tuple(rows.shape)}, want [{batch.num_seqs}, K]"
        )
    return rows


class ContextLogprobs:
    """Fills ``token_extras[out]`` and ``extras[on]`` from the context rows ``extras[rows]``.
    ``needs``: the round inputs it reads (default: the rows; none when the workflow writes them)."""

    def __init__(self, policy: Any, rows: str, out: str, on: str, needs: tuple[str, ...] | None = None):
        self.policy, self.rows, self.out, self.on = policy, rows, out, on
        self.needs_inputs: tuple[str, ...] = (rows,) if needs is None else needs

    def fill(self, batch: PackedBatch, micro_batches: int) -> dict[str, float]:
        """In place (collective: every rank); the fraction of sequences forwarded with a context."""
        rows = rows_of(batch, self.rows, self.out)
        lp, has = self_teacher_logprobs(self.policy, batch, rows, micro_batches)
        self.store(batch, lp)
        batch.extras[self.on] = has.to(torch.float64)
        return {f"{self.out}/forwarded_frac": float(has.double().mean()) if has.numel() else 0.0}

    def store(self, batch: PackedBatch, lp: torch.Tensor) -> None:
        """Where the logprobs [T] go: ``token_extras[out]``."""
        batch.token_extras[self.out] = lp


def context_logprobs(batch: PackedBatch, out: str, on: str, fallback: torch.Tensor) -> torch.Tensor:
    """``token_extras[out]`` [T] where ``extras[on]`` is set, ``fallback`` [T] on the other
    sequences (so their shift ``context - fallback`` is exactly 0). Errors name the input."""
    lp = batch.token_extras.get(out)
    if lp is None or on not in batch.extras:
        raise ValueError(f"the batch carries no '{out}' (the {out} learner input fills it)")
    has = batch.extras[on].bool()[batch.seq_index()]
    return torch.where(has, lp.to(fallback.dtype), fallback)
