"""SKALD: an annealed, exponentially tilted distillation term behind an empirical per-prompt gate
(formula, reconstructed: reference/distillation.py:skald_tilted_loss, skald_beta, skald_gate).

Per token, from the student's logits z_S and the teacher's q_T (full vocabulary, vocab-parallel):

    w_β(v) = q_T(v) · p_S(v)^β / Σ_u q_T(u) · p_S(u)^β          (stop-gradient)
    L_β    = −Σ_v w_β(v) · log p_S(v)                           gradient w.r.t. z_S: p_S − w_β
    β_t    = β_0 · max(0, 1 − step / anneal_steps)              (anneal_steps = 0: β_0 throughout)

The tilt down-weights teacher-preferred tokens the student finds very unlikely; at β = 0 it is the
teacher cross-entropy, whose gradient is the forward-KL one, p_S − q_T. Registered as the
regulariser ``skald``: ``objective.regularisers: [{name: skald, coef: λ, ...}]`` adds
λ · agg(g_i · L_β) to the policy loss, g_i the gate of the sample's prompt, computed once per step
in ``prepare``:

- ``teacher_advantage``: open when Â_T = acc(teacher-context rollouts) − acc(student rollouts) >
  ``margin``; the teacher's accuracy per sample's prompt comes in ``extras['teacher_acc']`` [B],
  measured by the method (``method.teacher_samples`` > 0: rollouts of the policy reading the skill
  card with ``skald_self``, megarl/methods/distillation/skill_cards.py; rollouts of the external
  teacher with ``skald`` / ``skald_topk``, megarl/methods/distillation/teacher_solutions.py) or given;
- ``zero_variance``: open on groups whose rewards are all equal (no GRPO signal);
- ``always``.

The teacher's logits reach the loss as ``LossContext.teacher_logits`` [T, V/tp], sharded like the
student's (the ``teacher_logits`` input of a Megatron teacher, ``teacher.hf_dir``; or, with the
regulariser ``skald_self``, the ``self_teacher_logits`` input: the policy itself reading a
privileged context, the abstract's teacher when ``inputs.self_teacher_context`` has ``source:
skill_card``). The regulariser
``skald_topk`` restricts the tilt to the teacher's top-K ids (input ``teacher_topk``: a Megatron or
an engine-served teacher; K values per token instead of V/tp): q_T renormalised over the K ids, the
student's logprobs gathered at them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from megarl.advantages.estimators import scalar_rewards
from megarl.objectives.regularisers import REGULARISERS
from megarl.ops import comm
from megarl.ops.segments import broadcast_to_tokens, group_all_equal, group_mean
from megarl.ops.vocab_parallel import vocab_parallel_gather_logprobs, vocab_parallel_logsumexp
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodParts, MethodSpec
from megarl.plugin.teacher_config import teacher_config
from megarl.registry import PartInfo

GATE = "skald_gate"  # extras [B]: 1.0 where the sample's prompt is distilled
TEACHER_ACC = "teacher_acc"  # extras [B]: accuracy of the teacher-context rollouts of the prompt
GATES = ("teacher_advantage", "zero_variance", "always")


def skald_beta(step: int, beta0: float, anneal_steps: int) -> float:
    """β_t = β_0 · max(0, 1 − step/anneal_steps); β_0 at every step when anneal_steps = 0."""
    if anneal_steps <= 0:
        return float(beta0)
    return float(beta0) * max(0.0, 1.0 - step / anneal_steps)


def tilted_log_weights(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, tp_group: Any = None
) -> torch.Tensor:
    """log w_β(v) on this rank's vocabulary shard, [T, V/tp] (no gradient); Σ_v w_β(v) = 1 over the
    full vocabulary."""
    acc = torch.promote_types(student_logits.dtype, torch.float32)
    zs, zt = student_logits.detach().to(acc), teacher_logits.detach().to(acc)
    log_ps = zs - vocab_parallel_logsumexp(zs, tp_group).unsqueeze(-1)
    log_qt = zt - vocab_parallel_logsumexp(zt, tp_group).unsqueeze(-1)
    a = log_qt + beta * log_ps
    return a - vocab_parallel_logsumexp(a, tp_group).unsqueeze(-1)


def tilted_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, tp_group: Any = None
) -> torch.Tensor:
    """L_β per token, [T, V/tp] -> [T], the same value on every TP rank; its gradient w.r.t. this
    rank's student logits is p_S − w_β on the shard."""
    acc = torch.promote_types(student_logits.dtype, torch.float32)
    w = torch.exp(tilted_log_weights(student_logits, teacher_logits, beta, tp_group))
    z = student_logits.to(acc)
    mine = (w * z).sum(-1)  # Σ_v w z over this shard (differentiable)
    total = comm.all_reduce(mine.detach().clone(), "sum", tp_group)
    # the value is lse − Σ_v w z over the full vocabulary; the other shards' part is a constant here
    return vocab_parallel_logsumexp(z, tp_group) - (mine + (total - mine.detach()))


def tilted_topk_loss(
    student_logits: torch.Tensor,
    ids: torch.Tensor,
    teacher_topk_logp: torch.Tensor,
    beta: float,
    tp_group: Any = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """L_β restricted to the teacher's top-K ids [T, K] (their logprobs [T, K] renormalised over the
    K): w_k ∝ q̄_T(k) p_S(k)^β over the K ids, L = −Σ_k w_k log p_S(k); [T, V/tp] -> [T]. With K = V
    it is ``tilted_loss``."""
    ls = vocab_parallel_gather_logprobs(student_logits, ids.long().clamp(min=0), tp_group, chunk_tokens)
    lq = torch.log_softmax(teacher_topk_logp.to(ls.dtype), -1)
    w = torch.softmax(lq + beta * ls.detach(), -1)
    return -(w * ls).sum(-1)


def prepare(
    batch,
    dp_group: Any,
    state: Any = None,
    *,
    beta0: float = 1.0,
    anneal_steps: int = 0,
    gate: str = "zero_variance",
    margin: float = 0.0,
    correct_threshold: float = 0.5,
):
    """The gate of every sample's prompt -> ``extras['skald_gate']`` (whole groups are on this rank)."""
    if gate not in GATES:
        raise ValueError(f"regulariser skald: gate={gate!r}; known: {', '.join(GATES)}")
    if beta0 < 0 or anneal_steps < 0:
        raise ValueError(f"regulariser skald: beta0={beta0!r} and anneal_steps={anneal_steps!r} must be >= 0")
    r = scalar_rewards(batch)
    if gate == "always":
        g = torch.ones_like(r)
    elif gate == "zero_variance":
        g = group_all_equal(r, batch.group_ids).double()
    else:
        t = batch.extras.get(TEACHER_ACC)
        if t is None:
            raise ValueError(
                f"regulariser skald with gate=teacher_advantage needs extras['{TEACHER_ACC}'] [B] "
                "(the accuracy of teacher-context rollouts of each sample's prompt)"
            )
        student_acc = group_mean((r > correct_threshold).double(), batch.group_ids)
        g = ((t.double() - student_acc) > margin).double()
    return dataclasses.replace(batch, extras={**batch.extras, GATE: g})


def skald(logits, logp, old_logp, batch, ctx, **knobs) -> torch.Tensor:
    """Per-token g_i · L_{β_t} (the objective aggregates it and multiplies by ``coef``)."""
    if GATE not in batch.extras:
        raise ValueError(
            "regulariser skald: batch.extras has no 'skald_gate': call objective.prepare(batch, "
            "dp_group) on the whole batch before splitting it"
        )
    if ctx.teacher_logits is None:
        raise ValueError(
            "regulariser skald needs the teacher's logits (LossContext.teacher_logits [T, V/tp])"
        )
    beta = skald_beta(ctx.step, knobs.get("beta0", 1.0), knobs.get("anneal_steps", 0))
    g = broadcast_to_tokens(batch.extras[GATE].to(logp.dtype), batch.cu_seqlens)
    return g * tilted_loss(logits, ctx.teacher_logits, beta, ctx.tp_group).to(logp.dtype)


def skald_topk(logits, logp, old_logp, batch, ctx, **knobs) -> torch.Tensor:
    """Per-token g_i · L_{β_t} over the teacher's top-K (``token_extras`` teacher_topk_ids/logprobs)."""
    if GATE not in batch.extras:
        raise ValueError(
            "regulariser skald_topk: batch.extras has no 'skald_gate': call objective.prepare(batch, "
            "dp_group) on the whole batch before splitting it"
        )
    ex = batch.token_extras
    if "teacher_topk_ids" not in ex or "teacher_topk_logprobs" not in ex:
        raise ValueError(
            "regulariser skald_topk needs token_extras teacher_topk_ids/logprobs (input teacher_topk)"
        )
    beta = skald_beta(ctx.step, knobs.get("beta0", 1.0), knobs.get("anneal_steps", 0))
    ids = ex["teacher_topk_ids"].to(logits.device)
    lq = ex["teacher_topk_logprobs"].to(logits.device)
    g = broadcast_to_tokens(batch.extras[GATE].to(logp.dtype), batch.cu_seqlens)
    return g * tilted_topk_loss(logits, ids, lq, beta, ctx.tp_group, ctx.chunk_tokens).to(logp.dtype)


REGULARISERS.add("skald", skald, PartInfo(batch_inputs=("teacher_logits",), prepare=prepare))
REGULARISERS.add("skald_topk", skald_topk, PartInfo(batch_inputs=("teacher_topk",), prepare=prepare))
# the same term with the self-teacher's logits (the policy reading a privileged context: a skill card)
REGULARISERS.add("skald_self", skald, PartInfo(batch_inputs=("self_teacher_logits",), prepare=prepare))


@dataclass
class SkaldKnobs(Knobs):
    """``teacher_samples``: the teacher's rollouts per prompt (the policy reading the skill card with
    ``skald_self``, the external teacher with ``skald`` / ``skald_topk``), whose accuracy is
    ``extras['teacher_acc']`` (the ``teacher_advantage`` gate's teacher accuracy; 0: none measured,
    the gate then needs ``teacher_acc`` from elsewhere)."""

    teacher_samples: int = 0

    def check(self) -> None:
        """``teacher_samples`` >= 0."""
        if self.teacher_samples < 0:
            raise ValueError(f"method.teacher_samples={self.teacher_samples} must be >= 0")


def build(ctx, knobs: SkaldKnobs) -> MethodParts:
    """With ``method.teacher_samples`` > 0, the part that measures the teacher's accuracy per
    prompt into ``extras['teacher_acc']``: with ``skald_self`` (the skill-card self-teacher) a round
    processor sampling the policy reading the card (rank 0; ``inputs.self_teacher_context`` with
    ``source: skill_card``); with ``skald`` / ``skald_topk`` (an external teacher) a step hook
    sampling the teacher itself (megarl/methods/distillation/teacher_solutions.py, nothing appended)."""
    if knobs.teacher_samples == 0:
        return MethodParts()
    cfg = ctx.cfg
    regs = [r for r in cfg.objective.regularisers if r["name"] in ("skald", "skald_topk", "skald_self")]
    thr = float(regs[0].get("correct_threshold", 0.5)) if regs else 0.5
    if not any(r["name"] == "skald_self" for r in regs):
        return MethodParts(step_hooks=[_external_accuracy(ctx, knobs.teacher_samples, thr)])
    from megarl.methods.distillation.self_teacher import CONTEXT, ContextKnobs
    from megarl.methods.distillation.skill_cards import CardAccuracy, CardTexts, read_cards
    from megarl.plugin.knobs import build_knobs

    ck = build_knobs(ContextKnobs, dict(cfg.inputs.get(CONTEXT) or {}), f"inputs.{CONTEXT}")
    if ck.source != "skill_card":
        raise ValueError(
            f"method skald: method.teacher_samples={knobs.teacher_samples} with skald_self measures the "
            f"skill-card self-teacher's accuracy: set inputs.{CONTEXT}.source: skill_card and its cards file"
        )
    if not ctx.rank0:
        return MethodParts()
    texts = CardTexts(read_cards(ck.cards), ctx.dataset)
    return MethodParts(round_processors=[CardAccuracy(ctx, texts, ck.template, knobs.teacher_samples, thr)])


def _external_accuracy(ctx, samples: int, threshold: float):
    """The step hook measuring an external teacher's accuracy on every prompt of the step."""
    from megarl.methods.distillation.teacher_solutions import TeacherSolutions
    from megarl.plugin.core_inputs import teacher_hf_config

    cfg = ctx.cfg
    if cfg.async_loop.enabled:
        raise ValueError(
            "method skald: method.teacher_samples > 0 with an external teacher samples it within the "
            "step: set async_loop.enabled: false"
        )
    teacher_hf = teacher_hf_config(cfg, ctx.hf_config) if teacher_config(cfg).source != "engine" else None
    return TeacherSolutions(
        ctx,
        lambda b: torch.ones(b.num_seqs, dtype=torch.bool),
        samples,
        threshold,
        "skald",
        teacher_hf,
        acc_key=TEACHER_ACC,
        append=False,
    )


SPEC = MethodSpec(
    name="skald",
    summary="SKALD: GRPO + an annealed, exponentially tilted teacher cross-entropy on gated prompts",
    provenance="reconstructed",
    knobs=SkaldKnobs,
    build=build,
    config={
        "advantage": {"estimator": "grpo"},
        "objective": {
            "regularisers": [
                {"name": "skald", "coef": 1.0, "beta0": 1.0, "anneal_steps": 200, "gate": "zero_variance"}
            ]
        },
    },
)
