"""The contract between the learner and every objective.

An objective is called once per micro-batch on the last pipeline stage::

    out = objective(logits, batch, ctx)      # logits: [T, V/tp], aligned to batch.tokens
    out.loss.backward()

``out.loss`` is this micro-batch's *contribution* to the global loss: summing it over all
micro-batches on all data-parallel ranks gives exactly the loss of the whole global batch. This is
what the global normalisers in ``ctx`` are for (token counts and sequence counts of the *global*
batch, computed once before micro-batching). So data-parallel gradient reduction must SUM, not
average (or the caller multiplies by the DP size after an averaging reduction).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megarl.batch import PackedBatch
from megarl.ops import comm
from megarl.ops.segments import segment_sum


@dataclass(frozen=True)
class GlobalNormalisers:
    """Denominators of the global batch (all micro-batches, all DP ranks).

    num_tokens: loss tokens in the global batch (token-mean).
    num_seqs: sequences with at least one loss token (seq-mean-*).
    max_response_len: the constant of seq-mean-token-sum-norm (Dr.GRPO); 0 = use the global max.
    """

    num_tokens: float
    num_seqs: float
    max_response_len: float = 0.0

    @staticmethod
    def from_batch(
        batch: PackedBatch, dp_group: Any = None, max_response_len: float = 0.0
    ) -> GlobalNormalisers:
        """Count over this rank's whole (pre-split) batch, summed over ``dp_group`` when given."""
        ntok = segment_sum(batch.loss_mask.double(), batch.cu_seqlens)
        stats = torch.tensor(
            [float(ntok.sum()), float((ntok > 0).sum()), float(ntok.max())], dtype=torch.float64
        )
        counts, longest = stats[:2].clone(), stats[2:].clone()
        comm.all_reduce(counts, "sum", dp_group)
        comm.all_reduce(longest, "max", dp_group)
        stats = torch.cat([counts, longest])
        return GlobalNormalisers(
            num_tokens=float(stats[0]),
            num_seqs=float(stats[1]),
            max_response_len=float(max_response_len or stats[2]),
        )


def step_normalisers(
    objective: Any, batch: PackedBatch, given: GlobalNormalisers | None, dp_group: Any = None
) -> GlobalNormalisers:
    """The normalisers of one optimizer step on the *prepared* ``batch``: the caller's ``given``
    (counted before ``objective.prepare``) unless the objective declares ``narrows_loss_mask``
    (its prepare took tokens out of the loss mask), then recounted over ``dp_group`` with the
    caller's ``max_response_len``; counted here when ``given`` is None. Collective on every DP
    rank alike (the flag is configuration, not data)."""
    if given is None:
        return GlobalNormalisers.from_batch(batch, dp_group)
    if getattr(objective, "narrows_loss_mask", False):
        return GlobalNormalisers.from_batch(batch, dp_group, given.max_response_len)
    return given


@dataclass
class LossContext:
    """What an objective needs besides logits and batch: groups and global normalisers."""

    normalisers: GlobalNormalisers
    tp_group: dist.ProcessGroup | None = None  # vocab-parallel group of the logits; None = TP 1
    chunk_tokens: int | None = None  # token chunk of the vocab-parallel ops; None: ~2**24 elements
    step: int = 0  # optimizer step (for schedules inside objectives)
    teacher_logits: torch.Tensor | None = None  # [T, V/tp], same sharding, for full-vocab distillation
    # (logprobs [T], entropy [T]) of batch.tokens from the learner's fused output layer
    # (megarl/learner/fused_output.py), with their graph; set only for an objective whose
    # ``accepts_token_stats()`` is True, which is then called with ``logits=None``
    token_stats: tuple[torch.Tensor, torch.Tensor] | None = None
    # an exactly on-policy update (one optimizer step on weights unchanged since the batch's old
    # logprobs would be computed): the old logprobs are this forward's, detached, instead of a
    # second forward pass; objectives that support it declare ``current_old_logprobs = True``
    old_is_current: bool = False
    # outputs of the learner's extra output heads on the policy's trunk (megarl/learner/heads.py),
    # name -> [T] aligned like the logits, with their graph: a loss on them trains the head and
    # the trunk in the same backward; {} when the learner has none
    heads: dict[str, torch.Tensor] = field(default_factory=dict)


def micro_batch_context(
    ctx: LossContext, mb: PackedBatch, device: Any = None, heads: dict[str, torch.Tensor] | None = None
) -> LossContext:
    """``ctx`` for one micro-batch: the teacher's logits travel with their tokens in the batch
    (``mb.token_extras["teacher_logits"]`` [T, V/tp], same sharding as the logits) and reach the
    objective as ``LossContext.teacher_logits`` (moved to ``device`` when given); ``heads``: the
    micro-batch's output-head outputs (``LossContext.heads``)."""
    if heads:
        ctx = dataclasses.replace(ctx, heads=heads)
    t = mb.token_extras.get("teacher_logits")
    if t is None:
        return ctx
    return dataclasses.replace(ctx, teacher_logits=t if device is None else t.to(device))


@dataclass
class LossOutput:
    """``loss``: scalar contribution of this micro-batch. ``metrics``: detached scalars that are
    already globally normalised the same way, so summing them over micro-batches and ranks gives
    the global value."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


class Objective(Protocol):
    """Anything callable as ``objective(logits [T, V/tp], batch, ctx) -> LossOutput``.

    An objective that needs nothing of the logits but the per-token logprobs and entropies of
    ``batch.tokens`` may also define ``accepts_token_stats() -> bool``; where it returns True the
    learner may call it with ``logits=None`` and ``ctx.token_stats`` set (the fused output layer).
    One with ``prepare(batch, dp_group) -> batch`` gets it called on each DP rank's whole batch
    before micro-batching; where that prepare takes tokens out of the loss mask it declares
    ``narrows_loss_mask = True`` and the learner recounts the normalisers (``step_normalisers``).
    """

    def __call__(self, logits: torch.Tensor, batch: PackedBatch, ctx: LossContext) -> LossOutput: ...
