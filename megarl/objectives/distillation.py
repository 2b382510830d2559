"""On-policy distillation terms (formulas: reference/distillation.py), registered by name.

``fn(logits [T, V/tp], logp [T], old_logp [T], batch, ctx) -> per-token loss [T]``. Each declares
the teacher input it reads: ``teacher_logprobs`` (sampled tokens) or ``teacher_logits`` (the
full-vocabulary modes: the teacher's logits reach the loss as ``LossContext.teacher_logits``,
sharded like the student's).
"""

from __future__ import annotations

import torch

from megarl.ops.vocab_parallel import vocab_parallel_hellinger_sq, vocab_parallel_jsd, vocab_parallel_kl
from megarl.registry import Registry

DISTILLATION: Registry = Registry("distill")


@DISTILLATION.register("none", reads_logits=False)
def none(logits, logp, old_logp, batch, ctx):
    return torch.zeros_like(logp)


def sampled_reverse_kl_term(logp, old_logp, teacher_logp):
    """-sg(teacher_logp - old_logp) · exp(logp - sg(old_logp)) per token [T], for any teacher's
    sampled-token logprobs (an external teacher, a self-teacher)."""
    return -(teacher_logp - old_logp).detach() * torch.exp(logp - old_logp.detach())


@DISTILLATION.register("sampled_reverse_kl", batch_inputs=("teacher_logprobs",), reads_logits=False)
def sampled_reverse_kl(logits, logp, old_logp, batch, ctx):
    """-sg(teacher_logp - old_logp) · exp(logp - sg(old_logp)); needs batch.teacher_logprobs."""
    if batch.teacher_logprobs is None:
        raise ValueError("distill=sampled_reverse_kl needs the batch field 'teacher_logprobs'")
    return sampled_reverse_kl_term(logp, old_logp, batch.teacher_logprobs)


def _teacher(ctx):
    if ctx.teacher_logits is None:
        raise ValueError("full-vocabulary distillation needs LossContext.teacher_logits [T, V/tp]")
    return ctx.teacher_logits.detach()


@DISTILLATION.register("forward_kl", batch_inputs=("teacher_logits",))
def forward_kl(logits, logp, old_logp, batch, ctx):
    """KL(teacher || student) per token over the full vocabulary."""
    return vocab_parallel_kl(_teacher(ctx), logits, ctx.tp_group, ctx.chunk_tokens)


@DISTILLATION.register("reverse_kl", batch_inputs=("teacher_logits",))
def reverse_kl(logits, logp, old_logp, batch, ctx):
    """KL(student || teacher) per token over the full vocabulary."""
    return vocab_parallel_kl(logits, _teacher(ctx), ctx.tp_group, ctx.chunk_tokens)


@DISTILLATION.register("jsd", batch_inputs=("teacher_logits",))
def jsd(logits, logp, old_logp, batch, ctx):
    """Jensen-Shannon divergence between student and teacher per token over the full vocabulary."""
    return vocab_parallel_jsd(logits, _teacher(ctx), ctx.tp_group, ctx.chunk_tokens)


@DISTILLATION.register("hellinger", batch_inputs=("teacher_logits",))
def hellinger(logits, logp, old_logp, batch, ctx):
    """Squared Hellinger distance between student and teacher per token over the full vocabulary."""
    return vocab_parallel_hellinger_sq(logits, _teacher(ctx), ctx.tp_group, ctx.chunk_tokens)
