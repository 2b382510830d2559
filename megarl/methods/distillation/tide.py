"""TIDE: token-level independent deficit-excess correction (formulas and provenance, the authors'
code: reference/distillation.py ``tide_loss``, ``tide_gates``, ``tide_deficit``, ``tide_h``).

Per visited state, the teacher-student disagreement splits into two branches:

- excess: the student sampled a token the teacher finds unlikely (a_t = log p_T - log q_old < 0);
  its PPO slot gets the bounded Hellinger-shaped advantage h(a_t) = 2(exp(a_t/2) - 1) > -2, on the
  batch's top ρ⁻ of [-a]_+ (gate A⁻);
- deficit: the teacher prefers tokens the student rarely samples; each of the teacher's top-K ids
  gets its own PPO slot with advantage λ p̄_t(v) (p̄: the teacher's top-K renormalised), on the
  batch's top ρ⁺ of the deficit statistic d_t = max(0, KL_topK(p̄ || q_old)) (gate A⁺). Its logit
  gradient λ(q_θ - p̄) does not vanish as q_θ(v) -> 0, so unsampled teacher tokens regain mass.

Registered as the regulariser ``tide`` (``objective.regularisers: [{name: tide, coef: 1.0, ...}]``)
with ``policy_loss: none``. Inputs: ``teacher_logprobs`` [T], ``teacher_topk`` (ids and logprobs
[T, K] in ``token_extras``; K = ``inputs.teacher_topk.top_k``, 16 as in the authors' script) and
``student_topk_logprobs`` (this module's provider: one forward-only pass of the policy before the
update, its logprobs at the teacher's top-K ids, the q_old of the deficit slots). The gates are
batch-global: ``prepare`` computes τ⁻ and τ⁺ (torch.quantile of the values all-gathered over the
data-parallel group, exact) once per optimizer step on the whole batch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

import megarl.plugin.core_inputs  # noqa: F401  (the teacher's providers register, so run, before ours)
from megarl.methods.distillation.opd_signal import behaviour_logprobs
from megarl.objectives.regularisers import REGULARISERS
from megarl.ops.quantile import gather_variable
from megarl.ops.segments import broadcast_to_tokens
from megarl.ops.vocab_parallel import vocab_parallel_gather_logprobs
from megarl.plugin.inputs import InputProvider, register_provider
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo

TAU_MINUS, TAU_PLUS = "tide_tau_minus", "tide_tau_plus"  # extras [B]: the step's global thresholds
IDS, TEACHER, STUDENT = "teacher_topk_ids", "teacher_topk_logprobs", "student_topk_logprobs"


def excess_shaping(a: torch.Tensor) -> torch.Tensor:
    """h(a) = 2(exp(a/2) - 1) (expm1: exact sign near 0) with a/2 clamped at 60 (bounded below by -2)."""
    return 2.0 * torch.expm1(torch.clamp(a / 2, max=60.0))


def deficit_statistic(teacher_topk: torch.Tensor, student_topk: torch.Tensor) -> torch.Tensor:
    """d_t = max(0, Σ_v p̄(v)(log p̄(v) - log q(v))) over the top-K; [T, K] x2 -> [T] (float64)."""
    lbar = torch.log_softmax(teacher_topk.double(), -1)
    pbar = lbar.exp()
    terms = torch.where(pbar > 0, pbar * (lbar - student_topk.double()), torch.zeros_like(pbar))
    return torch.clamp(terms.sum(-1), min=0.0)


def global_threshold(x: torch.Tensor, rho: float, group: Any) -> torch.Tensor:
    """Quantile_{1-ρ} of the values of every DP rank (+inf: ρ = 0 or none, -inf: ρ = 1)."""
    if rho <= 0:
        return torch.tensor(math.inf, dtype=torch.float64)
    if rho >= 1:
        return torch.tensor(-math.inf, dtype=torch.float64)
    allx = gather_variable(x.detach().double(), group)
    if allx.numel() == 0:
        return torch.tensor(math.inf, dtype=torch.float64)
    return torch.quantile(allx, 1.0 - rho)


def _signals(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(a [T], d [T]) in float64 from the batch's teacher inputs and behaviour logprobs."""
    if batch.teacher_logprobs is None:
        raise ValueError("regulariser tide needs the batch field 'teacher_logprobs' (teacher.hf_dir)")
    missing = [k for k in (IDS, TEACHER, STUDENT) if k not in batch.token_extras]
    if missing:
        raise ValueError(
            f"regulariser tide needs token_extras[{missing[0]!r}] (inputs teacher_topk and "
            "student_topk_logprobs)"
        )
    a = batch.teacher_logprobs.double() - behaviour_logprobs(batch, "regulariser tide")
    ex = batch.token_extras
    return a, deficit_statistic(ex[TEACHER], ex[STUDENT])


def prepare(batch, dp_group: Any, state: Any = None, *, rho_minus: float = 0.2, rho_plus: float = 0.2, **_):
    """τ⁻ and τ⁺ of the global batch (over every DP rank's loss tokens) into ``batch.extras``."""
    if STUDENT not in batch.token_extras:  # not the last pipeline stage: no loss runs here
        return batch
    a, d = _signals(batch)
    valid = batch.loss_mask > 0
    tau_m = global_threshold(torch.clamp(-a, min=0.0)[valid], rho_minus, dp_group)
    tau_p = global_threshold(d[valid], rho_plus, dp_group)
    B = batch.num_seqs
    extras = {**batch.extras, TAU_MINUS: tau_m.expand(B).clone(), TAU_PLUS: tau_p.expand(B).clone()}
    return dataclasses.replace(batch, extras=extras)


def gates(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(A⁻, A⁺) [T] bool against the prepared thresholds."""
    a, d = _signals(batch)
    if TAU_MINUS not in batch.extras:
        raise ValueError(
            "regulariser tide: batch.extras has no 'tide_tau_minus': call objective.prepare(batch, "
            "dp_group) on the whole batch before splitting it"
        )
    cu, valid = batch.cu_seqlens, batch.loss_mask > 0
    neg = torch.clamp(-a, min=0.0)
    in_minus = valid & (neg >= broadcast_to_tokens(batch.extras[TAU_MINUS], cu)) & (a < 0)
    return in_minus, valid & (d >= broadcast_to_tokens(batch.extras[TAU_PLUS], cu))


def tide(
    logits,
    logp,
    old_logp,
    batch,
    ctx,
    rho_minus: float = 0.2,
    rho_plus: float = 0.2,
    lam: float = 1.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> torch.Tensor:
    """Per-token TIDE loss: PPO-clip slots of the sampled token (excess) and of the teacher's top-K
    ids (deficit); the objective aggregates it and multiplies it by ``coef``."""
    in_minus, in_plus = gates(batch)
    ex = batch.token_extras
    a = (batch.teacher_logprobs.double() - old_logp.detach().double()).to(logp.dtype)
    excess = excess_shaping(a) * in_minus.to(logp.dtype)
    pbar = torch.softmax(ex[TEACHER].to(logits.device).double(), -1).to(logp.dtype)
    deficit = lam * pbar * in_plus.to(logp.dtype).unsqueeze(-1)
    lq = vocab_parallel_gather_logprobs(logits, ex[IDS].to(logits.device).clamp(min=0), ctx.tp_group)
    lq_old = ex[STUDENT].to(logits.device).to(logp.dtype)

    def slot(r: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        return torch.maximum(-r * adv, -torch.clamp(r, 1 - clip_low, 1 + clip_high) * adv)

    sampled = slot(torch.exp(logp - old_logp.detach()), excess)
    return sampled + slot(torch.exp(lq.to(logp.dtype) - lq_old), deficit).sum(-1)


class PolicyTopkPass:
    """``student_topk_logprobs``: the policy's logprobs (no gradient, before the update) at the
    teacher's top-K ids, ``token_extras`` [T, K] on the last pipeline stage. Runs after the
    teacher's pass (providers run in registration order)."""

    def __init__(self, policy: Any):
        self.policy = policy

    def fill(self, batch, micro_batches: int) -> dict[str, float]:
        """In place (collective)."""
        logits = self.policy.compute_logits(batch, micro_batches)
        if logits is None:
            return {}
        if IDS not in batch.token_extras:
            raise ValueError("student_topk_logprobs needs the teacher's top-K ids (input teacher_topk)")
        g = self.policy.groups
        ids = batch.token_extras[IDS].to(logits.device).clamp(min=0)
        with torch.no_grad():
            lq = vocab_parallel_gather_logprobs(logits, ids, g.tp if g.layout.tp > 1 else None)
        batch.token_extras[STUDENT] = lq.float().cpu()
        return {}


register_provider(
    InputProvider(
        (STUDENT,),
        "learner",
        lambda ctx, names: PolicyTopkPass(ctx.policy),
        summary="the policy's logprobs at the teacher's top-K ids, before the update",
    )
)
REGULARISERS.add(
    "tide", tide, PartInfo(batch_inputs=("teacher_logprobs", "teacher_topk", STUDENT), prepare=prepare)
)

SPEC = MethodSpec(
    name="tide",
    summary="TIDE: bounded Hellinger excess shaping + teacher top-K deficit injection on gated tokens",
    provenance="code",
    config={
        "objective": {
            "policy_loss": "none",
            "aggregation": "token-mean",
            "regularisers": [
                {
                    "name": "tide",
                    "coef": 1.0,
                    "rho_minus": 0.2,
                    "rho_plus": 0.2,
                    "lam": 1.0,
                    "clip_low": 0.2,
                    "clip_high": 0.2,
                }
            ],
        },
        "inputs": {"teacher_topk": {"top_k": 16}},
    },
)
