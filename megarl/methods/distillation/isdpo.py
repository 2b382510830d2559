"""I-SDPO: one route per prompt. Groups with no correct sample distil from the self-teacher (the
policy reading the prompt with its reference answer); the others train with GRPO. Formula and
provenance: reference/self_distillation.py (reconstructed from the abstract; the distillation term
is SDPO's sampled-token reverse KL).

Parts: the ``isdpo`` route rule (``inputs.routes.rule``: route 0 ``grpo``, route 1 ``distil``, from
``extras['self_teacher_correct']``), the ``isdpo`` policy loss (PPO clip on the grpo route, λ_SD ·
sampled-token reverse KL toward ``batch.self_teacher_logprobs`` on the distil route, each route
normalised by its own global count), and the method spec. The self-teacher forwards only the
all-wrong groups' samples (``inputs.self_teacher_context.when: group_all_wrong``).
"""

from __future__ import annotations

from dataclasses import dataclass

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
from megarl.methods.distillation.self_teacher import CORRECT, LOGITS, LOGPROBS, ON
from megarl.objectives.distillation import sampled_reverse_kl_term
from megarl.objectives.policy_losses import POLICY_LOSSES, ppo
from megarl.objectives.regularisers import REGULARISERS
from megarl.ops.vocab_parallel import vocab_parallel_kl
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo

NAMES = ("grpo", "distil")


def correctness(batch) -> torch.Tensor:
    """[B] bool verdicts of the round's correctness check (``extras['self_teacher_correct']``)."""
    c = batch.extras.get(CORRECT)
    if c is None:
        raise ValueError(
            f"route rule isdpo needs extras['{CORRECT}'] (the self_teacher_context round input writes it)"
        )
    return c > 0.5


@ROUTE_RULES.register("isdpo")
def isdpo_rule(batch) -> RouteDecision:
    """Route 1 (distil) for groups with no correct sample, route 0 (grpo) otherwise."""
    routes = group_routes(batch.group_ids, correctness(batch), lambda c: int(not bool(c.any())))
    return RouteDecision(routes, NAMES)


def _prepare(batch, dp_group, state, aggregation: str = "token-mean", sd_coef: float = 1.0):
    return prepare_routes(batch, len(NAMES), dp_group)


def isdpo_loss(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=0.2,
    clip_high=0.28,
    dual_clip=None,
    aggregation: str = "token-mean",
    sd_coef: float = 1.0,
    batch=None,
    ctx=None,
):
    """Per-token loss: route scale x (PPO clip on grpo groups | sd_coef x sampled reverse KL toward
    the self-teacher on distil groups). ``aggregation`` must be the objective's (the method checks)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"policy_loss_args.aggregation={aggregation!r}; known: {', '.join(AGGREGATIONS)}")
    teacher = getattr(batch, LOGPROBS)
    if teacher is None:
        raise ValueError(f"policy_loss=isdpo needs the batch field '{LOGPROBS}'")
    distil = batch.extras["routes"].to(logp.dtype).repeat_interleave(batch.seq_lens)
    on = batch.extras[ON].to(logp.dtype).repeat_interleave(batch.seq_lens)
    pg = ppo(logp, old_logp, adv, mask, cu_seqlens, clip_low, clip_high, dual_clip)
    sd = sampled_reverse_kl_term(logp, old_logp, teacher.to(logp.dtype)) * on
    scale = route_scale(batch, ctx.normalisers, aggregation).to(logp.dtype)
    return scale * ((1 - distil) * pg + sd_coef * distil * sd)


POLICY_LOSSES.add(
    "isdpo",
    isdpo_loss,
    PartInfo(batch_inputs=("routes", LOGPROBS), prepare=_prepare, needs_context=True),
)


def isdpo_kl(logits, logp, old_logp, batch, ctx, aggregation: str = "token-mean"):
    """Full-vocabulary distillation of the distil route: route scale x KL(self-teacher ‖ policy)
    per token over the vocabulary (vocab-parallel), the self-teacher's logits from
    ``LossContext.teacher_logits`` (stop-gradient); 0 on the grpo route and on sequences the
    self-teacher did not read. Use with ``policy_loss_args.sd_coef: 0``."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(
            f"regularisers: isdpo_kl aggregation={aggregation!r}; known: {', '.join(AGGREGATIONS)}"
        )
    distil = batch.extras["routes"].to(logp.dtype).repeat_interleave(batch.seq_lens)
    on = batch.extras[ON].to(logp.dtype).repeat_interleave(batch.seq_lens)
    scale = route_scale(batch, ctx.normalisers, aggregation).to(logp.dtype) * distil * on
    if ctx.teacher_logits is None:
        # no sequence the self-teacher read (no privileged forward, so no logits): nothing to distil
        if bool((scale != 0).any()):
            raise ValueError(f"regulariser isdpo_kl needs the self-teacher's logits (the {LOGITS} input)")
        return torch.zeros_like(logp)
    kl = vocab_parallel_kl(ctx.teacher_logits.detach(), logits, ctx.tp_group, ctx.chunk_tokens)
    return scale * kl


REGULARISERS.add(
    "isdpo_kl",
    isdpo_kl,
    PartInfo(
        batch_inputs=("routes", LOGITS), prepare=lambda b, g, st, **kw: prepare_routes(b, len(NAMES), g)
    ),
)


@dataclass
class ISDPOKnobs(Knobs):
    """No knobs of its own: λ_SD is ``objective.policy_loss_args.sd_coef``."""


build = route_aggregation_check("token-mean")


SPEC = MethodSpec(
    name="isdpo",
    summary="I-SDPO: all-wrong groups distil from the self-teacher (answer in context), others GRPO",
    provenance="reconstructed",
    config={
        "advantage": {"estimator": "grpo"},
        "objective": {
            "policy_loss": "isdpo",
            "aggregation": "token-mean",
            "policy_loss_args": {"aggregation": "token-mean", "sd_coef": 1.0},
        },
        "inputs": {
            "routes": {"rule": "isdpo"},
            "self_teacher_context": {"source": "answer", "when": "group_all_wrong"},
        },
    },
    knobs=ISDPOKnobs,
    build=build,
)
