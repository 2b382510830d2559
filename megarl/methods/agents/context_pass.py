"""A learner pass: the policy's own logprobs of the batch's tokens with a per-sample context row
inserted after the prompt (one forward-only pass of the same learner over the sequences that have
a context; megarl.methods.distillation.self_teacher.self_teacher_logprobs).

The rows come from a round input (``batch.extras[rows]``, NaN-padded token ids, an all-NaN row: no
context); the logprobs go to ``batch.token_extras[out]`` [T] (0 on sequences without a context,
which ``batch.extras[on]`` [B] marks 0), so they travel with their tokens through
micro-batch and data-parallel splits.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.methods.distillation.self_teacher import self_teacher_logprobs


class ContextLogprobs:
    """Fills ``token_extras[out]`` and ``extras[on]`` from the context rows ``extras[rows]``."""

    def __init__(self, policy: Any, rows: str, out: str, on: str):
        self.policy, self.rows, self.out, self.on = policy, rows, out, on
        self.needs_inputs: tuple[str, ...] = (rows,)  # the round input it reads

    def fill(self, batch: PackedBatch, micro_batches: int) -> dict[str, float]:
        """In place (collective: every rank); the fraction of sequences forwarded with a context."""
        rows = batch.extras.get(self.rows)
        if rows is None:
            raise ValueError(
                f"{self.out}: the batch carries no '{self.rows}' rows "
                f"(the {self.rows} round input fills them)"
            )
        lp, has = self_teacher_logprobs(
            self.policy, batch, torch.as_tensor(rows, dtype=torch.float64), micro_batches
        )
        batch.token_extras[self.out] = lp
        batch.extras[self.on] = has.to(torch.float64)
        return {f"{self.out}/forwarded_frac": float(has.double().mean()) if has.numel() else 0.0}


def context_logprobs(batch: PackedBatch, out: str, on: str, fallback: torch.Tensor) -> torch.Tensor:
    """``token_extras[out]`` [T] where ``extras[on]`` is set, ``fallback`` [T] on the other
    sequences (so their shift ``context - fallback`` is exactly 0). Errors name the input."""
    lp = batch.token_extras.get(out)
    if lp is None or on not in batch.extras:
        raise ValueError(f"the batch carries no '{out}' (the {out} learner input fills it)")
    has = batch.extras[on].bool()[batch.seq_index()]
    return torch.where(has, lp.to(fallback.dtype), fallback)
