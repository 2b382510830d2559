"""RSTG: GRPO plus teacher guidance only where GRPO has no signal (formula, reconstructed:
reference/distillation.py:rstg_loss).

Per-token loss, aggregated by the objective (one normaliser for every term):

    PPO-clip(A)                                              student samples (GRPO advantages)
  + α · c_i · M_t · (−sg(ℓ_t) · exp(logp − sg old))          samples of negative zero-variance groups
  + γ · (−logp)                                              correct teacher solutions of those groups

- negative zero-variance (NZV) group: no student sample of the prompt is correct (reward >
  ``correct_threshold``); mixed and all-correct groups get no distillation and no SFT gradient;
- ℓ_t = log π_T − log π_old (the sampled-token OPD reward), c_i = exp(mean_t log π_T) ∈ (0, 1]
  the teacher's geometric-mean probability of the student's sample;
- M_t = [H_t ≥ top ρ_H of H] or [|ℓ_t| ≥ top ρ_D of |ℓ|], the top fractions taken over the loss
  tokens of every NZV sample of the global batch (all DP ranks: megarl.ops.quantile), H_t the
  behaviour policy's full-vocabulary entropy (``entropies``);
- teacher solutions are sequences flagged ``extras['teacher_solution']`` (1.0) in the group of
  their prompt; they take no part in the GRPO advantages (the ``rstg`` estimator) nor in the NZV
  test. The method's step hook (``method.teacher_samples`` > 0,
  megarl/methods/distillation/teacher_solutions.py) samples them from the teacher for the NZV
  groups only, keeps those the run's reward verifies and appends them before the learner inputs.
  Without them γ has no effect.

``prepare`` (once per step, the DP rank's whole batch) computes the per-sequence weights and the
two global thresholds into ``batch.extras``; each micro-batch then applies them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, grpo, per_token, scalar_rewards
from megarl.methods.distillation.opd_signal import behaviour_logprobs
from megarl.methods.distillation.teacher_solutions import TEACHER_SOLUTION, TeacherSolutions
from megarl.objectives.distillation import sampled_reverse_kl_term
from megarl.objectives.policy_losses import POLICY_LOSSES, ppo
from megarl.ops.quantile import top_fraction_threshold
from megarl.ops.segments import _dense_groups, broadcast_to_tokens, segment_sum
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodParts, MethodSpec
from megarl.plugin.teacher_config import teacher_config
from megarl.registry import PartInfo

WEIGHT, SFT, THR_H, THR_D = "rstg_weight", "rstg_sft", "rstg_thr_entropy", "rstg_thr_divergence"


def teacher_solutions(batch) -> torch.Tensor:
    """[B] bool: sequences flagged ``extras['teacher_solution']`` (none when the key is absent)."""
    t = batch.extras.get(TEACHER_SOLUTION)
    if t is None:
        return torch.zeros(batch.num_seqs, dtype=torch.bool)
    if t.shape != (batch.num_seqs,):
        raise ValueError(
            f"extras['{TEACHER_SOLUTION}'] has shape {tuple(t.shape)}, expected [{batch.num_seqs}]"
        )
    return t > 0.5


def nzv_groups(correct: torch.Tensor, group_ids: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """[B] bool: the sequence's group has student samples and none of them is correct."""
    inv, n = _dense_groups(group_ids)
    hits = torch.zeros(n, dtype=torch.long).index_add(0, inv, (correct & student).long())
    size = torch.zeros(n, dtype=torch.long).index_add(0, inv, student.long())
    return ((hits == 0) & (size > 0))[inv]


def _rstg_advantages(batch, scale_by_std: bool = True, eps: float = 1e-6):
    """GRPO advantages over the student samples; 0 on teacher solutions."""
    r, student = scalar_rewards(batch), ~teacher_solutions(batch)
    adv = torch.zeros_like(r)
    if bool(student.any()):
        adv[student] = grpo(r[student], batch.group_ids[student], scale_by_std, eps)
    return per_token(batch, adv)


def prepare(
    batch,
    dp_group: Any,
    state: Any = None,
    *,
    alpha: float = 1.0,
    gamma: float = 1.0,
    rho_entropy: float = 0.2,
    rho_divergence: float = 0.2,
    correct_threshold: float = 0.5,
):
    """Per-sequence OPD weights c_i (NZV students) and SFT flags, and the global entropy and
    divergence thresholds (over every DP rank's NZV loss tokens), into ``batch.extras``."""
    if batch.teacher_logprobs is None:
        raise ValueError("policy_loss=rstg needs the batch field 'teacher_logprobs' (set teacher.hf_dir)")
    if batch.entropies is None:
        raise ValueError("policy_loss=rstg needs the batch field 'entropies' (behaviour-policy entropy)")
    old = behaviour_logprobs(batch, "policy_loss=rstg")
    correct = scalar_rewards(batch) > correct_threshold
    solution = teacher_solutions(batch)
    nzv = nzv_groups(correct, batch.group_ids, ~solution)
    m = batch.loss_mask.double()
    n = segment_sum(m, batch.cu_seqlens)
    mean_t = segment_sum(batch.teacher_logprobs.double() * m, batch.cu_seqlens) / n.clamp(min=1)
    conf = torch.exp(mean_t)
    weight = torch.where(nzv & ~solution & (n > 0), conf, torch.zeros_like(conf))
    sft = (nzv & solution & correct).double()
    pool = (m > 0) & broadcast_to_tokens(weight > 0, batch.cu_seqlens)
    div = (batch.teacher_logprobs.double() - old).abs()
    thr_h = top_fraction_threshold(batch.entropies.double()[pool], rho_entropy, dp_group)
    thr_d = top_fraction_threshold(div[pool], rho_divergence, dp_group)
    B = batch.num_seqs
    extras = {
        **batch.extras,
        WEIGHT: weight,
        SFT: sft,
        THR_H: thr_h.double().expand(B).clone(),
        THR_D: thr_d.double().expand(B).clone(),
    }
    return dataclasses.replace(batch, extras=extras)


def token_gate(batch) -> torch.Tensor:
    """[T] bool M_t: high behaviour entropy or large |teacher − old| against the prepared thresholds."""
    if WEIGHT not in batch.extras:
        raise ValueError(
            "policy_loss=rstg: batch.extras has no 'rstg_weight': call objective.prepare(batch, "
            "dp_group) on the whole batch before splitting it"
        )
    old = behaviour_logprobs(batch, "policy_loss=rstg")
    div = (batch.teacher_logprobs.double() - old).abs()
    cu = batch.cu_seqlens
    hi_h = batch.entropies.double() >= broadcast_to_tokens(batch.extras[THR_H], cu)
    hi_d = div >= broadcast_to_tokens(batch.extras[THR_D], cu)
    return hi_h | hi_d


def rstg_loss(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=0.2,
    clip_high=0.28,
    dual_clip=None,
    alpha: float = 1.0,
    gamma: float = 1.0,
    rho_entropy: float = 0.2,
    rho_divergence: float = 0.2,
    correct_threshold: float = 0.5,
    batch=None,
    ctx=None,
):
    """Per-token RSTG loss (see the module docstring); the objective aggregates it."""
    gate = token_gate(batch).to(logp.dtype)
    w = broadcast_to_tokens(batch.extras[WEIGHT].to(logp.dtype), cu_seqlens) * gate
    sft = broadcast_to_tokens(batch.extras[SFT].to(logp.dtype), cu_seqlens)
    student = broadcast_to_tokens((~teacher_solutions(batch)).to(logp.dtype), cu_seqlens)
    pg = ppo(logp, old_logp, adv, mask, cu_seqlens, clip_low, clip_high, dual_clip) * student
    opd = sampled_reverse_kl_term(logp, old_logp, batch.teacher_logprobs.to(logp.dtype))
    return pg + alpha * w * opd - gamma * sft * logp


def _token_metrics(logp, old_logp, adv, mask, cu_seqlens, batch=None, ctx=None, **_knobs):
    """Fractions of the batch's loss tokens that are distilled (NZV and gated) and SFT'd."""
    w = broadcast_to_tokens(batch.extras[WEIGHT], cu_seqlens) > 0
    return {
        "distilled_token_frac": (w & token_gate(batch)).to(logp.dtype),
        "sft_token_frac": broadcast_to_tokens(batch.extras[SFT], cu_seqlens).to(logp.dtype),
        "nzv_token_frac": w.to(logp.dtype),
    }


POLICY_LOSSES.add(
    "rstg",
    rstg_loss,
    PartInfo(
        batch_inputs=("teacher_logprobs", "entropies"),
        prepare=prepare,
        needs_context=True,
        token_metrics=_token_metrics,
    ),
)
ADVANTAGE_ESTIMATORS.add("rstg", _rstg_advantages, PartInfo(group_relative=True))


@dataclass
class RSTGKnobs(Knobs):
    """``teacher_samples``: solutions sampled from the teacher per NZV group and appended when the
    run's reward verifies them (0: none; the SFT term then has no effect)."""

    teacher_samples: int = 2

    def check(self) -> None:
        """``teacher_samples`` >= 0."""
        if self.teacher_samples < 0:
            raise ValueError(f"method.teacher_samples={self.teacher_samples} must be >= 0")


def nzv_students(batch, correct_threshold: float = 0.5) -> torch.Tensor:
    """[B] bool: the student samples of NZV groups (the groups that get teacher solutions)."""
    student = ~teacher_solutions(batch)
    correct = scalar_rewards(batch) > correct_threshold
    return nzv_groups(correct, batch.group_ids, student) & student


TEACHER_ROWS = "rstg_teacher_rows"  # extras [B]: 1 on NZV student samples (the teacher's rows)


def build(ctx, knobs: RSTGKnobs) -> MethodParts:
    """The step hook (every rank) that marks the NZV student samples (``extras['rstg_teacher_rows']``:
    the only rows the teacher forwards, ``inputs.teacher_logprobs.rows``) and appends verified
    teacher solutions of their groups (``method.teacher_samples`` > 0)."""
    cfg = ctx.cfg
    if knobs.teacher_samples and cfg.async_loop.enabled:
        raise ValueError(
            "method rstg with method.teacher_samples > 0 needs the synchronous loop (the teacher's "
            "solutions are sampled within the step): set async_loop.enabled: false or "
            "method.teacher_samples: 0"
        )
    from megarl.plugin.core_inputs import teacher_hf_config

    sampled = knobs.teacher_samples > 0 and teacher_config(cfg).source != "engine"
    teacher_hf = teacher_hf_config(cfg, ctx.hf_config) if sampled else None
    thr = float(dict(cfg.objective.policy_loss_args).get("correct_threshold", 0.5))
    hook = TeacherSolutions(
        ctx, lambda b: nzv_students(b, thr), knobs.teacher_samples, thr, "rstg", teacher_hf, TEACHER_ROWS
    )
    return MethodParts(step_hooks=[hook])


SPEC = MethodSpec(
    name="rstg",
    summary="RSTG: GRPO + confidence-weighted OPD on gated tokens of all-wrong groups + teacher SFT",
    provenance="reconstructed",
    knobs=RSTGKnobs,
    build=build,
    config={
        "advantage": {"estimator": "rstg"},
        "inputs": {"teacher_logprobs": {"rows": TEACHER_ROWS}},
        "objective": {
            "policy_loss": "rstg",
            "policy_loss_args": {"alpha": 1.0, "gamma": 1.0, "rho_entropy": 0.2, "rho_divergence": 0.2},
        },
    },
)
