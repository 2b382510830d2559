"""A context teacher: the policy's own weights reading each prompt with a per-sample context that a
round part or the rollout workflow wrote as rows of token ids (NaN-padded) in ``batch.extras``.

One learner pass (every rank, collective) per input name: ``<rows>_logprobs`` forwards only the
sequences whose row is not all NaN, ``prompt + context + response``, with the self-teacher's forward
(megarl.methods.distillation.self_teacher.self_teacher_logprobs), and writes the logprobs of the
batch's tokens to ``batch.self_teacher_logprobs`` [T] (0 on sequences not forwarded) and which
sequences it forwarded to ``extras['self_teacher_on']`` [B]. Registered here for two row keys:
``coach_context`` (a coach's knowledge, Experiential Learning) and ``instruction_context`` (the
instruction a sample was drawn with, the ``instructed`` workflow).
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.methods.distillation.self_teacher import ON, self_teacher_logprobs
from megarl.plugin.inputs import InputProvider, register_provider

COACH_ROWS = "coach_context"
INSTRUCTION_ROWS = "instruction_context"
COACH_LOGPROBS = "coach_logprobs"
INSTRUCTION_LOGPROBS = "instruction_logprobs"


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


class ContextTeacher:
    """The learner pass of the module docstring for the rows in ``extras[key]``."""

    def __init__(self, policy: Any, key: str, name: str, needs: tuple[str, ...] = ()):
        self.policy, self.key, self.name = policy, key, name
        self.needs_inputs = needs  # round inputs it reads (none when the workflow writes the rows)

    def fill(self, batch: PackedBatch, micro_batches: int) -> dict[str, float]:
        """In place (collective); the fraction of sequences forwarded with a context."""
        rows = rows_of(batch, self.key, self.name)
        lp, has = self_teacher_logprobs(self.policy, batch, rows, micro_batches, "with_context")
        batch.self_teacher_logprobs = lp
        batch.extras[ON] = has.to(torch.float64)
        return {f"{self.name}/forwarded_frac": float(has.double().mean()) if has.numel() else 0.0}


register_provider(
    InputProvider(
        (COACH_LOGPROBS,),
        "learner",
        lambda ctx, names: ContextTeacher(ctx.policy, COACH_ROWS, COACH_LOGPROBS, (COACH_ROWS,)),
        summary="the policy's own logprobs with the coach's knowledge after the prompt (one extra forward)",
    )
)
register_provider(
    InputProvider(
        (INSTRUCTION_LOGPROBS,),
        "learner",
        lambda ctx, names: ContextTeacher(ctx.policy, INSTRUCTION_ROWS, INSTRUCTION_LOGPROBS),
        summary="the policy's own logprobs with each sample's exploration instruction after the prompt "
        "(environment.name: instructed; one extra forward)",
    )
)
