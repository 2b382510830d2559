"""Equivalence harness: run megarl's objective on a packed, TP-sharded, micro-batched, DP-split
batch and the reference loss on the same batch padded with full logits; return both losses and
both logits gradients so a test can compare them.

A *case* is plain data (tensors on CPU, no process group), so it can be rebuilt on every rank or
shipped to worker processes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.batch import PackedBatch, unpack
from megarl.objectives.api import GlobalNormalisers, LossContext
from megarl.objectives.rl_objective import ObjectiveConfig, build_objective, resolved_clip
from megarl.testing.simulated_group import SimulatedWorld
from reference.loss import rl_loss


@dataclass
class Case:
    """A global batch, its full logits [T, V] (and teacher logits), and an objective config."""

    batch: PackedBatch
    logits: torch.Tensor  # [T, V]
    cfg: ObjectiveConfig
    teacher_logits: torch.Tensor | None = None  # [T, V]
    extra: dict = field(default_factory=dict)


def reference_loss_and_grad(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference loss on the padded batch and d loss / d logits mapped back to packed [T, V]."""
    b, cfg = case.batch, case.cfg
    pad = unpack(b)
    am = pad.attention_mask
    V = case.logits.shape[-1]
    full = torch.zeros(am.shape + (V,), dtype=case.logits.dtype)
    full[am] = case.logits
    full.requires_grad_(True)
    teacher = None
    if case.teacher_logits is not None:
        teacher = torch.zeros_like(full, requires_grad=False)
        teacher[am] = case.teacher_logits
    tok = pad.per_token
    old = tok.get("old_logprobs", tok.get("rollout_logprobs"))
    loss = rl_loss(
        full,
        pad.tokens,
        pad.loss_mask,
        tok["advantages"],
        old,
        policy_loss=cfg.policy_loss,
        clip_low=resolved_clip(cfg)["clip_low"],
        clip_high=resolved_clip(cfg)["clip_high"],
        dual_clip=resolved_clip(cfg)["dual_clip"],
        aggregation_mode=cfg.aggregation,
        max_len=case.extra.get("max_len"),
        kl_coef=cfg.kl_coef,
        kl_estimator=cfg.kl_estimator,
        ref_logp=tok.get("ref_logprobs"),
        entropy_coef=cfg.entropy_coef,
        correction=cfg.correction,
        rollout_logp=tok.get("rollout_logprobs"),
        corr_low=cfg.correction_low,
        corr_high=cfg.correction_high,
        correction_chain=cfg.correction_chain,
        correction_normalise=cfg.correction_normalise,
        correction_denominator=cfg.correction_denominator,
        distill=cfg.distill,
        distill_coef=cfg.distill_coef,
        teacher_logp=tok.get("teacher_logprobs"),
        teacher_logits=teacher,
    )
    loss.backward()
    return loss.detach(), full.grad[am]


def split_sequences(num_seqs: int, parts: int) -> list[list[int]]:
    """Contiguous, near-equal runs of sequence ids (empty runs dropped)."""
    bounds = torch.linspace(0, num_seqs, parts + 1).round().long().tolist()
    return [list(range(a, b)) for a, b in itertools.pairwise(bounds) if b > a]


def megarl_rank_loss_and_grad(
    case: Case,
    rank: int,
    group: Any,
    tp: int,
    dp: int = 1,
    micro_batches: int = 1,
    objective: Callable | None = None,
    chunk_tokens: int = 3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What TP rank ``rank`` computes: the summed loss contributions of every DP shard and
    micro-batch (DP ranks are played one after the other), and its gradient shard [T, V/tp].

    Sequences are split contiguously over DP ranks, then each DP share into micro-batches.
    """
    b = case.batch
    objective = objective or build_objective(case.cfg)
    V = case.logits.shape[-1]
    if V % tp:
        raise ValueError(f"vocabulary {V} is not divisible by tp={tp}")
    dp_shards = split_sequences(b.num_seqs, dp)
    max_len = case.extra.get("max_len") or 0.0
    dp_world = SimulatedWorld(len(dp_shards))
    norms = dp_world.run(lambda r, g: GlobalNormalisers.from_batch(b.select(dp_shards[r]), g, max_len))
    logits = case.logits.chunk(tp, -1)[rank]
    teacher = None if case.teacher_logits is None else case.teacher_logits.chunk(tp, -1)[rank]
    grad = torch.zeros_like(logits)
    total = torch.zeros((), dtype=torch.float64)
    starts = b.cu_seqlens[:-1]
    for r, shard in enumerate(dp_shards):
        for mb_ids in split_sequences(len(shard), micro_batches):
            ids = [shard[i] for i in mb_ids]
            tok_idx = torch.cat(
                [torch.arange(int(starts[i]), int(starts[i]) + int(b.seq_lens[i])) for i in ids]
            )
            shard_logits = logits[tok_idx].clone().requires_grad_(True)
            ctx = LossContext(
                normalisers=norms[r],
                tp_group=group,
                chunk_tokens=chunk_tokens,
                teacher_logits=None if teacher is None else teacher[tok_idx],
            )
            out = objective(shard_logits, b.select(ids), ctx)
            out.loss.backward()
            total = total + out.loss.detach().double()
            grad[tok_idx] = shard_logits.grad
    return total.to(logits.dtype), grad


def megarl_loss_and_grad(
    case: Case,
    tp: int,
    dp: int = 1,
    micro_batches: int = 1,
    objective: Callable | None = None,
    chunk_tokens: int = 3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss (checked identical on every TP rank) and the full packed gradient [T, V], with TP
    ranks simulated as threads."""
    outs = SimulatedWorld(tp).run(
        lambda rank, group: megarl_rank_loss_and_grad(
            case, rank, group, tp, dp, micro_batches, objective, chunk_tokens
        )
    )
    return gather_rank_results(outs)


def gather_rank_results(outs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Check that all TP ranks report the same loss; concatenate their gradient shards."""
    for r, o in enumerate(outs[1:], start=1):
        if not torch.equal(o[0], outs[0][0]):
            raise AssertionError(f"TP rank {r} reports loss {float(o[0])}, rank 0 {float(outs[0][0])}")
    return outs[0][0], torch.cat([o[1] for o in outs], -1)


def gloo_case_entry(rank: int, group: Any, payload: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """GlooPool entry point: payload = (case, tp, dp, micro_batches)."""
    case, tp, dp, mb = payload
    return megarl_rank_loss_and_grad(case, rank, group, tp, dp, mb)
