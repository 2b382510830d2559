"""CoKL: correctness-conditioned KL regulariser (formula: reference/trust_regions.py:cokl).

Registered in REGULARISERS as ``cokl``; config ``regularisers: [{name: cokl, coef: β, ...}]``.

CoKL is a softmax over the correct members of a group, so one member's loss depends on the
others, which may sit in other micro-batches. ``prepare`` (once per step, whole batch) therefore
evaluates the finite-group loss at the step's old log-probs s⁰ and stores, per sequence, its value
share v_i and gradient weight w_i = ∂L/∂s_i (both already divided by the global number of active
groups). Each micro-batch then contributes

    Σ_i v_i + Σ_t m_t · w_seq(t) · (logp_t − old_t)  =  L(s⁰) + ∇L(s⁰)·(s − s⁰),

which equals CoKL and its gradient exactly while the policy equals the one that produced
``old_logprobs`` (every micro-batch of the first optimizer step after the old-logprob pass), and is
its first-order expansion on later steps over the same rollouts. Requirement: a group's sequences
are on one data-parallel rank (the active-group count is summed over DP).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.objectives.regularisers import REGULARISERS
from megarl.ops import comm
from megarl.ops.segments import broadcast_to_tokens, segment_sum
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo

VALUE, WEIGHT = "cokl_value", "cokl_grad_weight"


def correct_mask(batch: PackedBatch, correct_threshold: float) -> torch.Tensor:
    """[B] bool: ``extras['correct']`` when given, else scalar reward >= threshold."""
    if "correct" in batch.extras:
        return batch.extras["correct"].bool()
    if batch.rewards is None or batch.rewards.dim() != 1:
        raise ValueError(
            "cokl needs batch.extras['correct'] ([B] bool) or scalar batch.rewards [B] "
            f"(got rewards of shape {None if batch.rewards is None else tuple(batch.rewards.shape)})"
        )
    return batch.rewards >= correct_threshold


def _first_of_duplicates(batch: PackedBatch) -> torch.Tensor:
    """[B] bool: False for a response whose tokens already appeared earlier in the same group."""
    keep, seen = [], set()
    starts, lens = batch.cu_seqlens[:-1].tolist(), batch.seq_lens.tolist()
    for _i, (st, n, p, g) in enumerate(
        zip(starts, lens, batch.prompt_lens.tolist(), batch.group_ids.tolist())
    ):
        key = (g, tuple(batch.tokens[st + p : st + n].tolist()))
        keep.append(key not in seen)
        seen.add(key)
    return torch.tensor(keep, dtype=torch.bool)


def _group_log_softmax(z: torch.Tensor, member: torch.Tensor, inv: torch.Tensor, G: int) -> torch.Tensor:
    """log softmax of z over the members of each group ([B] -> [B], -inf off the members)."""
    zm = torch.where(member, z, torch.full_like(z, -torch.inf))
    zmax = torch.full((G,), -torch.inf, dtype=z.dtype).scatter_reduce(0, inv, zm, "amax")
    zmax = torch.where(torch.isfinite(zmax), zmax, torch.zeros_like(zmax))
    denom = torch.zeros(G, dtype=z.dtype).index_add(0, inv, torch.exp(zm - zmax[inv]))
    return zm - zmax[inv] - torch.log(denom.clamp(min=torch.finfo(z.dtype).tiny))[inv]


def prepare(
    batch: PackedBatch,
    dp_group: Any,
    state: Any = None,
    *,
    correct_threshold: float = 1.0,
    temperature: float = 1.0,
    length_normalise: bool = False,
    dedup: bool = True,
) -> PackedBatch:
    """Per-sequence CoKL value shares and gradient weights at the old log-probs -> batch.extras."""
    if not temperature > 0:
        raise ValueError(f"cokl: temperature={temperature!r} must be > 0")
    old = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
    if old is None or batch.ref_logprobs is None:
        raise ValueError(
            "cokl needs the batch fields 'ref_logprobs' and 'old_logprobs' (or 'rollout_logprobs')"
        )
    dt = torch.float64
    m = batch.loss_mask.to(dt)
    n = segment_sum(m, batch.cu_seqlens)
    s = segment_sum(m * old.to(dt), batch.cu_seqlens)
    s_ref = segment_sum(m * batch.ref_logprobs.to(dt), batch.cu_seqlens)
    if length_normalise:
        s, s_ref = s / n.clamp(min=1), s_ref / n.clamp(min=1)
    member = correct_mask(batch, correct_threshold) & (n > 0)
    if dedup:
        member &= _first_of_duplicates(batch)
    inv = torch.unique(batch.group_ids, return_inverse=True)[1]
    G = int(inv.max()) + 1 if inv.numel() else 0
    size = torch.zeros(G, dtype=dt).index_add(0, inv, member.to(dt))
    member &= size[inv] >= 2
    log_q = _group_log_softmax(s / temperature, member, inv, G)
    log_q_ref = _group_log_softmax(s_ref / temperature, member, inv, G)
    q, q_ref = torch.exp(log_q), torch.exp(log_q_ref)
    zero = torch.zeros_like(s)
    value = torch.where(member, q_ref * (log_q_ref - log_q), zero)
    weight = torch.where(member, (q - q_ref) / temperature, zero)
    if length_normalise:
        weight = weight / n.clamp(min=1)
    active = torch.tensor([float((size >= 2).sum())], dtype=dt)
    comm.all_reduce(active, "sum", dp_group)
    k = max(float(active), 1.0)
    return dataclasses.replace(batch, extras={**batch.extras, VALUE: value / k, WEIGHT: weight / k})


def cokl(logits, logp, old_logp, batch: PackedBatch, ctx, **knobs) -> torch.Tensor:
    """This micro-batch's CoKL contribution (a scalar; see the module docstring)."""
    if VALUE not in batch.extras or WEIGHT not in batch.extras:
        raise ValueError(
            "cokl: batch.extras has no 'cokl_value'/'cokl_grad_weight': call "
            "objective.prepare(batch, dp_group) on the whole batch before splitting it"
        )
    w = broadcast_to_tokens(batch.extras[WEIGHT].to(logp.dtype), batch.cu_seqlens)
    m = batch.loss_mask.to(logp.dtype)
    return batch.extras[VALUE].to(logp.dtype).sum() + (m * w * (logp - old_logp)).sum()


REGULARISERS.add(
    "cokl", cokl, PartInfo(batch_inputs=("ref_logprobs",), prepare=prepare, aggregates_itself=True)
)

SPEC = MethodSpec(
    name="cokl",
    summary="CoKL: a group-contrastive KL regulariser to the reference",
    provenance="reconstructed",
    config={"objective": {"regularisers": [{"name": "cokl", "coef": 0.1}]}},
)
