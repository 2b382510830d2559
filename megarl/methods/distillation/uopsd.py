"""U-OPSD: label-free on-policy self-distillation. Per prompt, the majority answer of the group is
the pseudo-label; the self-teacher reads the prompt with the *shortest* rollout that gives it and
teaches the *longest* rollout that does not. Formula and provenance: reference/self_distillation.py
(reconstructed; the selection rule is SSOPD's with the verifier replaced by the majority vote).

Parts: the self-teacher's context (``inputs.self_teacher_context``: ``source: majority``, ``when:
longest_incorrect``, ``min_vote`` = τ, ``answer_pattern``), the ``uopsd`` route rule (route 1
``distil`` for groups with a target, route 0 ``skip``; the target is the one active sequence of its
group) and the ``uopsd`` policy loss (sampled-token reverse KL toward the self-teacher on the
targets, optionally weighted by the frontier weight 4 (|C|/G)(1 − |C|/G)). Nothing reads the ground
truth, the rewards or the advantages.
"""

from __future__ import annotations

import torch

from megarl.methods.distillation.routes import (
    AGGREGATIONS,
    ROUTE_RULES,
    RouteDecision,
    group_routes,
    prepare_routes,
    route_aggregation_check,
    route_scale,
)
from megarl.methods.distillation.self_teacher import CONTEXT, CORRECT, LOGITS, LOGPROBS, context_rows
from megarl.methods.distillation.vocab_divergence import token_divergence
from megarl.objectives.distillation import sampled_reverse_kl_term
from megarl.objectives.policy_losses import POLICY_LOSSES
from megarl.objectives.regularisers import REGULARISERS
from megarl.ops.segments import group_mean
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo

NAMES = ("skip", "distil")


def targets(batch) -> torch.Tensor:
    """[B] bool: the sequences with a self-teacher context (one per kept group)."""
    return ~torch.isnan(context_rows(batch)).all(1)


@ROUTE_RULES.register("uopsd")
def uopsd_rule(batch) -> RouteDecision:
    """Route 1 (distil) for groups with a target, 0 (skip) otherwise; only the target is active."""
    t = targets(batch)
    routes = group_routes(batch.group_ids, t, lambda x: int(bool(x.any())))
    return RouteDecision(routes, NAMES, active=t)


SHARE = "uopsd_agree_share"  # extras: [B] |C| / G of the sequence's group


def _prepare(
    batch,
    dp_group,
    state,
    aggregation: str = "seq-mean-token-mean",
    frontier: bool = False,
    sd_coef: float = 1.0,
):
    """Route counts over DP, and each group's majority share on the whole group (a micro-batch may
    hold part of a group; a DP rank holds whole groups)."""
    if CORRECT not in batch.extras:
        raise ValueError(f"policy_loss=uopsd needs extras['{CORRECT}'] (inputs.{CONTEXT})")
    batch.extras[SHARE] = group_mean(batch.extras[CORRECT].double(), batch.group_ids)
    return prepare_routes(batch, len(NAMES), dp_group)


def uopsd_loss(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=0.0,
    clip_high=0.0,
    dual_clip=None,
    aggregation: str = "seq-mean-token-mean",
    frontier: bool = False,
    sd_coef: float = 1.0,
    batch=None,
    ctx=None,
):
    """Per-token loss: route scale x frontier weight x ``sd_coef`` x sampled reverse KL toward the
    self-teacher, on the targets only (``adv`` is not read: no label enters the loss); ``sd_coef:
    0`` leaves the distillation to the ``uopsd_kl`` regulariser (full vocabulary or top-K)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"policy_loss_args.aggregation={aggregation!r}; known: {', '.join(AGGREGATIONS)}")
    teacher = getattr(batch, LOGPROBS)
    if teacher is None or SHARE not in batch.extras:
        raise ValueError(f"policy_loss=uopsd needs '{LOGPROBS}' and its prepare step (extras['{SHARE}'])")
    share = batch.extras[SHARE]
    w = 4 * share * (1 - share) if frontier else torch.ones_like(share)
    w_tok = w.to(logp.dtype).repeat_interleave(batch.seq_lens)
    sd = sampled_reverse_kl_term(logp, old_logp, teacher.to(logp.dtype))
    return route_scale(batch, ctx.normalisers, aggregation).to(logp.dtype) * w_tok * sd_coef * sd


def uopsd_kl(
    logits,
    logp,
    old_logp,
    batch,
    ctx,
    aggregation: str = "seq-mean-token-mean",
    frontier: bool = False,
    direction: str = "reverse",
    top_k: int = 0,
):
    """U-OPSD's distillation over the vocabulary: route scale x frontier weight x KL between the
    policy and the self-teacher (``LossContext.teacher_logits``, the ``self_teacher_logits``
    input; ``direction``: reverse = KL(policy ‖ teacher), U-OPSD's own; ``top_k`` > 0: over the
    teacher's top-K ids, renormalised) on the targets only. Use with ``policy_loss_args.sd_coef: 0``."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(
            f"regularisers: uopsd_kl aggregation={aggregation!r}; known: {', '.join(AGGREGATIONS)}"
        )
    if SHARE not in batch.extras:
        raise ValueError(f"regulariser uopsd_kl needs its prepare step (extras['{SHARE}'])")
    scale = route_scale(batch, ctx.normalisers, aggregation).to(logp.dtype)
    if ctx.teacher_logits is None:
        # a batch without a target has no privileged forward (the input leaves no logits): nothing to distil
        if bool((scale != 0).any()):
            raise ValueError(f"regulariser uopsd_kl needs the self-teacher's logits (the {LOGITS} input)")
        return torch.zeros_like(logp)
    share = batch.extras[SHARE]
    w = 4 * share * (1 - share) if frontier else torch.ones_like(share)
    w_tok = w.to(logp.dtype).repeat_interleave(batch.seq_lens)
    kl = token_divergence(logits, ctx.teacher_logits, direction, top_k, ctx.tp_group, ctx.chunk_tokens)
    return scale * w_tok * kl.to(logp.dtype)


POLICY_LOSSES.add(
    "uopsd",
    uopsd_loss,
    PartInfo(batch_inputs=("routes", LOGPROBS), prepare=_prepare, needs_context=True),
)

REGULARISERS.add(
    "uopsd_kl",
    uopsd_kl,
    PartInfo(batch_inputs=("routes", LOGITS), prepare=lambda b, g, st, **kw: _prepare(b, g, st)),
)

SPEC = MethodSpec(
    name="uopsd",
    summary="U-OPSD: the shortest majority-vote rollout in context teaches the longest dissenting one",
    provenance="reconstructed",
    config={
        "objective": {
            "policy_loss": "uopsd",
            "aggregation": "seq-mean-token-mean",
            "policy_loss_args": {"aggregation": "seq-mean-token-mean", "frontier": False},
        },
        "inputs": {
            "routes": {"rule": "uopsd"},
            "self_teacher_context": {"source": "majority", "when": "longest_incorrect", "min_vote": 0.5},
        },
    },
    build=route_aggregation_check("seq-mean-token-mean"),
)
