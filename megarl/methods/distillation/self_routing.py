"""Self-Routing: each prompt group goes, by its own samples' correctness and confidence, to GRPO,
on-policy self-distillation, a regulariser, or nowhere (formula, reconstructed:
reference/distillation.py:self_routing_routes, self_routing_loss).

Routes (per group, shared by its samples; p̂ = fraction correct, c̄ = mean confidence, the
confidence of a sample c_i = exp(mean_t log π_old) its geometric-mean token probability):

    0 < p̂ < 1          grpo        PPO clip with the GRPO advantage
    p̂ = 0              opsd        λ_SD · sampled-token reverse KL toward the self-teacher (the
                                   policy reading the prompt with its reference answer)
    p̂ = 1, c̄ < τ_c     regularise  λ_reg · (−log π_θ) on the group's own (correct) samples
    p̂ = 1, c̄ ≥ τ_c     skip        nothing, and no token in the normaliser

The per-token loss is scaled so that the objective's aggregate divides by the non-skipped routes'
global token count (token-mean) or sequence count (seq-mean-*): skipped groups neither train nor
dilute the others. Parts: the ``self_routing`` route rule (``inputs.routes.rule``), the
``self_routing`` policy loss, and the method spec; the route counts come from
megarl/methods/distillation/routes.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.methods.distillation.opd_signal import behaviour_logprobs
from megarl.methods.distillation.routes import (
    AGGREGATIONS,
    ROUTE,
    ROUTE_RULES,
    RouteDecision,
    group_routes,
    prepare_routes,
    route_aggregation_check,
    route_counts,
)
from megarl.methods.distillation.self_teacher import CORRECT, LOGPROBS, ON
from megarl.objectives.distillation import sampled_reverse_kl_term
from megarl.objectives.policy_losses import POLICY_LOSSES, ppo
from megarl.ops.segments import segment_sum
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo

NAMES = ("grpo", "opsd", "regularise", "skip")
GRPO, OPSD, REG, SKIP = range(4)


def confidence(batch) -> torch.Tensor:
    """[B] c_i = exp(mean over the loss tokens of log π_old) (1 for a sequence with no loss token)."""
    old = behaviour_logprobs(batch, "route rule self_routing")
    m = batch.loss_mask.double()
    n = segment_sum(m, batch.cu_seqlens)
    return torch.exp(segment_sum(old * m, batch.cu_seqlens) / n.clamp(min=1))


def route_of(correct: torch.Tensor, conf: torch.Tensor, tau_c: float) -> int:
    """The route of one group from its samples' correctness [n] (bool) and confidences [n]."""
    p = float(correct.double().mean())
    if 0.0 < p < 1.0:
        return GRPO
    if p == 0.0:
        return OPSD
    return SKIP if float(conf.double().mean()) >= tau_c else REG


@ROUTE_RULES.register("self_routing")
def self_routing_rule(batch, tau_c: float = 0.8) -> RouteDecision:
    """Routes from ``extras['self_teacher_correct']`` and the behaviour policy's confidence."""
    if not 0.0 <= tau_c <= 1.0:
        raise ValueError(f"inputs.routes.args.tau_c={tau_c!r} must be in [0, 1]")
    c = batch.extras.get(CORRECT)
    if c is None:
        raise ValueError(
            f"route rule self_routing needs extras['{CORRECT}'] "
            "(the self_teacher_context round input writes it)"
        )
    values = torch.stack([(c > 0.5).double(), confidence(batch)], 1)
    routes = group_routes(batch.group_ids, values, lambda v: route_of(v[:, 0] > 0.5, v[:, 1], tau_c))
    return RouteDecision(routes, NAMES)


def _prepare(
    batch, dp_group, state, aggregation: str = "token-mean", sd_coef: float = 1.0, reg_coef: float = 0.1
):
    return prepare_routes(batch, len(NAMES), dp_group)


def non_skip_scale(batch, norm, mode: str) -> torch.Tensor:
    """[T]: (the objective's global normaliser) / (the non-skipped routes' global count), 0 on
    skipped groups, so the aggregate divides by the non-skipped tokens (or sequences) only."""
    counts = route_counts(batch)
    keep = batch.extras[ROUTE].long() != SKIP
    if mode == "token-mean":
        s = max(norm.num_tokens, 1.0) / max(float(counts[0, :SKIP].sum()), 1.0)
    elif mode.startswith("seq-mean"):
        s = max(norm.num_seqs, 1.0) / max(float(counts[1, :SKIP].sum()), 1.0)
    else:
        raise ValueError(f"policy_loss_args.aggregation={mode!r}; known: {', '.join(AGGREGATIONS)}")
    return (keep.double() * s).repeat_interleave(batch.seq_lens)


def self_routing_loss(
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
    reg_coef: float = 0.1,
    batch=None,
    ctx=None,
):
    """Per-token loss: scale x (PPO clip | sd_coef x sampled reverse KL toward the self-teacher |
    reg_coef x (−logp) | 0) by the group's route; ``aggregation`` must be the objective's."""
    teacher = getattr(batch, LOGPROBS)
    if teacher is None:
        raise ValueError(f"policy_loss=self_routing needs the batch field '{LOGPROBS}'")
    route = batch.extras[ROUTE].long().repeat_interleave(batch.seq_lens)
    on = batch.extras[ON].to(logp.dtype).repeat_interleave(batch.seq_lens)
    pg = ppo(logp, old_logp, adv, mask, cu_seqlens, clip_low, clip_high, dual_clip)
    sd = sampled_reverse_kl_term(logp, old_logp, teacher.to(logp.dtype)) * on
    per_route = torch.stack([pg, sd_coef * sd, -reg_coef * logp, torch.zeros_like(logp)], 0)
    term = per_route.gather(0, route[None]).squeeze(0)
    return non_skip_scale(batch, ctx.normalisers, aggregation).to(logp.dtype) * term


POLICY_LOSSES.add(
    "self_routing",
    self_routing_loss,
    PartInfo(batch_inputs=(ROUTE, LOGPROBS), prepare=_prepare, needs_context=True),
)


@dataclass
class SelfRoutingKnobs(Knobs):
    """No knobs of its own: τ_c is ``inputs.routes.args.tau_c``; λ_SD, λ_reg are
    ``objective.policy_loss_args.sd_coef``, ``reg_coef``."""


build = route_aggregation_check("token-mean")


SPEC = MethodSpec(
    name="self_routing",
    summary="Self-Routing: groups routed by correctness x confidence to GRPO / self-distil / self-SFT / skip",
    provenance="reconstructed",
    config={
        "advantage": {"estimator": "grpo"},
        "objective": {
            "policy_loss": "self_routing",
            "aggregation": "token-mean",
            "policy_loss_args": {"aggregation": "token-mean", "sd_coef": 1.0, "reg_coef": 0.1},
        },
        "inputs": {
            "routes": {"rule": "self_routing", "args": {"tau_c": 0.8}},
            "self_teacher_context": {"source": "answer", "when": "group_all_wrong"},
        },
    },
    knobs=SelfRoutingKnobs,
    build=build,
)
