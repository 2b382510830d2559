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
from megarl.methods.agents.context_pass import ContextLogprobs
from megarl.methods.distillation.self_teacher import ON
from megarl.plugin.inputs import InputProvider, register_provider

COACH_ROWS = "coach_context"
INSTRUCTION_ROWS = "instruction_context"
COACH_LOGPROBS = "coach_logprobs"
INSTRUCTION_LOGPROBS = "instruction_logprobs"


class ContextTeacher(ContextLogprobs):
    """The learner pass of the module docstring for the rows in ``extras[key]``: ``ContextLogprobs``
    writing ``batch.self_teacher_logprobs`` and ``extras['self_teacher_on']``."""

    def __init__(self, policy: Any, key: str, name: str, needs: tuple[str, ...] = ()):
        super().__init__(policy, key, name, ON, needs)

    def store(self, batch: PackedBatch, lp: torch.Tensor) -> None:
        """The logprobs [T] are the batch's ``self_teacher_logprobs``."""
        batch.self_teacher_logprobs = lp


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
