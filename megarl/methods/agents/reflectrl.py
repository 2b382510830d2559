"""ReflectRL: learning from golden negative trajectories. The policy reflects on a failed expert
trajectory (reflective rollouts, prompt + reflection context), and a Reflective-to-Direct term
moves what the successful reflections found back to the plain prompt. Formula and provenance:
reference/agents.py ``reflectrl_advantages`` / ``reflectrl_loss`` (reconstructed; no source found).

Parts:

- the ``reflect`` rollout workflow (megarl/rollout/reflect.py): direct samples, reflective samples
  and transfer copies (the reflective responses as sequences of the plain prompt), with
  ``extras['reflect_role']`` (0/1/2) and ``extras['reflect_context']``;
- ``reflect_logprobs`` (learner input): log π_θ(y_t | T, y_<t) of the transfer copies, the policy
  reading each with its reflection context after the prompt again (one extra forward of the copies
  only; stop-gradient; the context teacher of megarl/methods/agents/context_teacher.py), in
  ``batch.self_teacher_logprobs``;
- the ``reflectrl`` advantage estimator: GRPO within each group's direct samples and within its
  reflective samples; a transfer copy gets its reflective twin's advantage when positive, else 0;
- the ``reflectrl`` policy loss: PPO clip on direct and reflective tokens; on transfer tokens
  r2d_coef x PPO clip of w_t = π_θ(y_t | x, y_<t) / sg(π_θ(y_t | T, y_<t));
- a round processor reporting the mean reward of direct and of reflective samples.

With no golden negatives (no ``environment.trajectories``, or every trajectory correct) every
sample is direct: GRPO with PPO clip, exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, grpo, per_token, scalar_rewards
from megarl.batch import PackedBatch
from megarl.methods.agents.context_teacher import ContextTeacher
from megarl.objectives.policy_losses import POLICY_LOSSES, ppo
from megarl.plugin.inputs import InputProvider, register_provider
from megarl.plugin.rounds import RolloutRound, RoundResult
from megarl.plugin.spec import MethodParts, MethodSpec
from megarl.registry import PartInfo
from megarl.rollout.reflect import CONTEXT, DIRECT, REFLECTIVE, ROLE, TRANSFER

LOGPROBS = "reflect_logprobs"


def roles(batch: PackedBatch) -> torch.Tensor:
    """[B] long ``extras['reflect_role']`` (an error says where it comes from)."""
    r = batch.extras.get(ROLE)
    if r is None:
        raise ValueError(
            f"reflectrl needs extras['{ROLE}'] (the 'reflect' rollout workflow: environment.name: reflect)"
        )
    return torch.as_tensor(r).round().long()


def reflectrl_seq_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    role: torch.Tensor,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """[B]: GRPO within (group, direct) and (group, reflective); transfer copies max(0, the
    reflective subgroup's normalised advantage of their reward)."""
    r = rewards.double()
    out = torch.zeros_like(r)
    live = role != TRANSFER
    if bool(live.any()):
        key = group_ids[live] * 2 + (role[live] == REFLECTIVE).long()
        out[live] = grpo(r[live], key, scale_by_std, eps)
    for g in torch.unique(group_ids[role == TRANSFER]).tolist():
        refl = r[(group_ids == g) & (role == REFLECTIVE)]
        t = (group_ids == g) & (role == TRANSFER)
        if refl.numel() < 2 or bool((refl == refl[0]).all()):
            continue
        a = r[t] - refl.mean()
        out[t] = (a / (refl.std() + eps) if scale_by_std else a).clamp(min=0)
    return out


def _reflectrl(batch: PackedBatch, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Per-sequence ReflectRL advantages on every loss token."""
    return per_token(
        batch,
        reflectrl_seq_advantages(scalar_rewards(batch), batch.group_ids, roles(batch), scale_by_std, eps),
    )


ADVANTAGE_ESTIMATORS.add("reflectrl", _reflectrl, PartInfo(group_relative=True))


def reflectrl_loss(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=0.2,
    clip_high=0.28,
    dual_clip=None,
    r2d_coef: float = 1.0,
    batch=None,
    ctx=None,
):
    """Per-token loss: PPO clip against ``old_logp`` on direct and reflective tokens; on transfer
    tokens r2d_coef x PPO clip against the reflective-context logprobs (stop-gradient)."""
    transfer = (roles(batch) == TRANSFER).repeat_interleave(batch.seq_lens)
    if bool(transfer.any()):
        refl = batch.self_teacher_logprobs
        if refl is None:
            raise ValueError(
                f"policy_loss=reflectrl needs the {LOGPROBS} input (batch.self_teacher_logprobs)"
            )
        old_logp = torch.where(transfer, refl.detach().to(logp.dtype), old_logp)
    loss = ppo(logp, old_logp, adv, mask, cu_seqlens, clip_low, clip_high, dual_clip)
    return torch.where(transfer, r2d_coef * loss, loss)


POLICY_LOSSES.add("reflectrl", reflectrl_loss, PartInfo(batch_inputs=(LOGPROBS,), needs_context=True))

register_provider(
    InputProvider(
        (LOGPROBS,),
        "learner",
        lambda ctx, names: ContextTeacher(ctx.policy, CONTEXT, LOGPROBS),
        summary="the policy's logprobs of each transfer copy with its reflection context after the prompt "
        "(the 'reflect' workflow's rows; one extra forward of the copies)",
    )
)


class RoleRewards:
    """A ``RoundProcessor`` (rank 0): the round's mean reward per role, ``reflectrl/reward_direct``
    and ``reflectrl/reward_reflective`` (the reflection advantage is their difference), and the
    share of reflective samples. Stateless; changes nothing."""

    async def process(self, r: RolloutRound) -> RoundResult:
        """Metrics only."""
        role = r.extras.get(ROLE)
        if role is None:
            return RoundResult()
        role_t = torch.as_tensor(role).round().long()
        out = {"reflectrl/reflective_frac": float((role_t == REFLECTIVE).double().mean())}
        for name, k in (("direct", DIRECT), ("reflective", REFLECTIVE)):
            sel = role_t == k
            if bool(sel.any()):
                out[f"reflectrl/reward_{name}"] = float(r.scalar[sel].double().mean())
        return RoundResult(metrics=out)

    def state_dict(self) -> dict:
        """Nothing to save."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore."""


def build(ctx: Any, knobs: Any) -> MethodParts:
    """The per-role reward metrics (rank 0)."""
    return MethodParts(round_processors=[RoleRewards()])


SPEC = MethodSpec(
    name="reflectrl",
    summary="ReflectRL: reflective rollouts on golden negative trajectories, transferred to the plain prompt",
    provenance="reconstructed",
    config={
        "environment": {"name": "reflect"},
        "advantage": {"estimator": "reflectrl"},
        "objective": {"policy_loss": "reflectrl", "policy_loss_args": {"r2d_coef": 1.0}},
    },
    build=build,
)
