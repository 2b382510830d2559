"""ICE + Asymmetric-RL/SD: instruction-conditioned exploration whose successes are distilled into the
unconditioned policy, registered as the policy loss ``ice`` (formula: reference/agents.py:ice_loss).
Reconstructed: no source was found; the formula is ours.

Rollouts come from the ``instructed`` workflow (megarl/rollout/instructed.py): each sample is drawn
with one of M exploration instructions, or none, after the prompt; the trained sequence is the plain
prompt and the response, and the group advantage A_i compares every sample of the prompt. Per token:

    ℓ_t = PPO-clip(π_θ(y_t|x, y_<t) / π_old(y_t|x, y_<t), A_i)
          + β · 1[A_i > 0 and sample i had an instruction]
              · (sg(log π_θ(y_t|x, I_j, y_<t)) − log π_θ(y_t|x, y_<t))

The second term is the sampled-token estimate of KL(π^sg(·|x, I_j) ‖ π_θ(·|x)) on tokens the
conditioned policy drew: its gradient moves the unconditioned policy toward the conditioned one's
successful samples (teacher = conditioned, stop-gradient; student = unconditioned), and negative
samples get the RL term alone. The conditioned logprobs come from one extra forward of the policy
(``instruction_logprobs``, megarl/methods/agents/context_teacher.py). The RL term is on the
unconditioned context (the spec's alternative reading): the learner trains one sequence per sample,
and the test-time policy reads no instruction. With no instructions, the loss is exactly PPO-clip
(GRPO with the method's estimator).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megarl.methods.agents.context_teacher import INSTRUCTION_LOGPROBS
from megarl.methods.distillation.self_teacher import ON
from megarl.objectives.policy_losses import POLICY_LOSSES, ppo
from megarl.ops.segments import broadcast_to_tokens, segment_masked_mean
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodParts, MethodSpec
from megarl.registry import PartInfo


def distilled(adv, mask, cu_seqlens, batch) -> torch.Tensor:
    """[T] 1.0 on the tokens of sequences with A_i > 0 that were drawn with an instruction."""
    if ON not in batch.extras:
        raise ValueError(f"policy_loss=ice needs extras['{ON}'] (the {INSTRUCTION_LOGPROBS} input)")
    pos = (segment_masked_mean(adv, mask, cu_seqlens) > 0) & (batch.extras[ON].to(adv.device) > 0.5)
    return broadcast_to_tokens(pos.to(adv.dtype), cu_seqlens)


def ice_loss(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=0.2,
    clip_high=0.28,
    dual_clip=None,
    *,
    sd_coef: float = 1.0,
    batch=None,
    ctx=None,
) -> torch.Tensor:
    """Per-token loss: PPO clip + sd_coef x (sg(conditioned logp) − logp) on positive instructed samples."""
    teacher = batch.self_teacher_logprobs
    if teacher is None:
        raise ValueError(
            f"policy_loss=ice needs the batch field 'self_teacher_logprobs' ({INSTRUCTION_LOGPROBS})"
        )
    pg = ppo(logp, old_logp, adv, mask, cu_seqlens, clip_low, clip_high, dual_clip)
    sd = teacher.to(logp.dtype).detach() - logp
    return pg + sd_coef * distilled(adv, mask, cu_seqlens, batch).to(logp.dtype) * sd


def _token_metrics(logp, old_logp, adv, mask, cu_seqlens, *, batch, **_):
    """Per token: whether it is distilled, and the sampled KL estimate there."""
    on = distilled(adv, mask, cu_seqlens, batch).to(logp.dtype)
    return {"sd_frac": on, "sd_kl": on * (batch.self_teacher_logprobs.to(logp.dtype) - logp.detach())}


POLICY_LOSSES.add(
    "ice",
    ice_loss,
    PartInfo(batch_inputs=(INSTRUCTION_LOGPROBS,), token_metrics=_token_metrics, needs_context=True),
)


@dataclass
class ICEKnobs(Knobs):
    """No knobs of its own: β is ``objective.policy_loss_args.sd_coef``, the instructions are
    ``environment.instructions``."""


def build(ctx: Any, knobs: ICEKnobs) -> MethodParts:
    """Checks that the rollouts come from the ``instructed`` workflow."""
    if ctx.cfg.environment.name != "instructed":
        raise ValueError(
            f"method ice: environment.name={ctx.cfg.environment.name!r}; ice samples with "
            "environment.name: instructed (and environment.instructions)"
        )
    return MethodParts()


SPEC = MethodSpec(
    name="ice",
    summary="ICE: instruction-conditioned exploration, positive samples distilled into the plain policy",
    provenance="reconstructed",
    config={
        "advantage": {"estimator": "grpo"},
        "environment": {"name": "instructed"},
        "objective": {"policy_loss": "ice", "policy_loss_args": {"sd_coef": 1.0}},
    },
    knobs=ICEKnobs,
    build=build,
)
