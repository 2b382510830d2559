"""SC-GRPO: GRPO whose token advantages are weighted by how much a verified sibling solution in
context changes the policy's distribution at that token. Formula and provenance:
reference/self_distillation.py (the multiplicative KL weight is the paper's; its exact form, the
per-sequence mean-1 normalisation, the clip and the sampled-token KL estimate are reconstructed).

The self-teacher (``inputs.self_teacher_context.source: sibling``) is the policy reading the prompt
with the shortest correct rollout of the same group other than the sample itself; a sample whose
group has no other correct rollout keeps w = 1 (its GRPO advantage). k_t is a sampled-token
estimate of the per-token KL between the self-conditioned and the original (old) policy, both
stop-gradient: no gradient flows through the weight.

Full-vocabulary and top-K variants (estimator ``sc_grpo_vocab``, the same knobs): k_t is the KL
between the two whole next-token distributions in the estimator's ``direction`` (forward =
KL(π_T ‖ π_θ), reverse = KL(π_θ ‖ π_T)), from the ``self_teacher_kl`` input
(``inputs.self_teacher_kl.top_k``: 0 = the full vocabulary, K = both restricted to the
self-teacher's top-K ids and renormalised), computed before the update by one privileged and one
plain forward of the policy (vocab-parallel, megarl/methods/distillation/vocab_divergence.py)
instead of the sampled-token estimate; the weight and advantages are then as above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, grpo, per_token, scalar_rewards
from megarl.batch import PackedBatch
from megarl.methods.distillation.self_teacher import CONTEXT, LOGPROBS, ON, context_rows, self_teacher_logits
from megarl.methods.distillation.vocab_divergence import token_divergence
from megarl.ops.segments import broadcast_to_tokens, segment_sum
from megarl.plugin.inputs import InputProvider, register_provider
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo

DIRECTIONS = ("reverse", "forward")


def token_kl(teacher_logp: torch.Tensor, old_logp: torch.Tensor, direction: str = "reverse") -> torch.Tensor:
    """[T] non-negative per-token KL estimate (float64): forward KL(π_T‖π_θ) = ρ log ρ − (ρ − 1),
    reverse KL(π_θ‖π_T) = (ρ − 1) − log ρ, with ρ = exp(teacher − old)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"advantage.direction={direction!r}; known: {', '.join(DIRECTIONS)}")
    d = teacher_logp.double() - old_logp.double()
    rho = torch.exp(d)
    return rho * d - (rho - 1) if direction == "forward" else (rho - 1) - d


def sc_weights(
    k: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    on: torch.Tensor,
    power: float = 1.0,
    w_max: float = 5.0,
    eps: float = 1e-8,
) -> torch.Tensor:
    """[T] w = clip(k^p / (per-sequence mean of k^p over loss tokens), 0, w_max); 1 on sequences
    without a sibling (``on`` [B] False) or whose mean is <= eps; 0 off the mask."""
    m = mask.double()
    kp = k.clamp(min=0) ** power * m
    mean = segment_sum(kp, cu_seqlens) / segment_sum(m, cu_seqlens).clamp(min=1)
    use = broadcast_to_tokens((mean > eps) & on.bool(), cu_seqlens)
    mean_t = broadcast_to_tokens(torch.where(mean > eps, mean, torch.ones_like(mean)), cu_seqlens)
    w = torch.where(use, kp / mean_t, torch.ones_like(kp))
    return w.clamp(0, w_max) * m


def _sc_grpo(
    batch: PackedBatch,
    direction: str = "reverse",
    power: float = 1.0,
    w_max: float = 5.0,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages times the self-conditioned KL weight on every loss token."""
    teacher, old = getattr(batch, LOGPROBS), batch.old_logprobs
    if teacher is None or old is None:
        raise ValueError(
            f"advantage.estimator=sc_grpo needs the batch fields '{LOGPROBS}' and 'old_logprobs'"
        )
    teacher, old = teacher.detach(), old.detach()  # the weight is data: no gradient flows through it
    if not power > 0 or not w_max > 0:
        raise ValueError(f"advantage.power={power} and advantage.w_max={w_max} must be > 0")
    on = batch.extras.get(ON, torch.ones(batch.num_seqs, dtype=torch.float64))
    w = sc_weights(token_kl(teacher, old, direction), batch.loss_mask, batch.cu_seqlens, on, power, w_max)
    return per_token(batch, grpo(scalar_rewards(batch), batch.group_ids, scale_by_std, eps)) * w


ADVANTAGE_ESTIMATORS.add(
    "sc_grpo",
    _sc_grpo,
    PartInfo(batch_inputs=("old_logprobs", LOGPROBS), group_relative=True),
)

KL = "self_teacher_kl"  # input / token_extras [T, 2]: k_t (forward, reverse) over the vocabulary


@dataclass
class KLKnobs(Knobs):
    """top_k: 0 = the full vocabulary, K = the self-teacher's top-K ids (renormalised)."""

    top_k: int = 0

    def check(self) -> None:
        """top_k >= 0."""
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0: the full vocabulary)")


class SelfTeacherKL:
    """The ``self_teacher_kl`` learner pass: per token of the sequences with a context, the KL
    between the policy with and without its privileged context in both directions
    (``token_extras['self_teacher_kl']`` [T, 2]: forward, reverse; 0 elsewhere; every pipeline
    stage) and ``extras['self_teacher_on']``."""

    def __init__(self, policy: Any, knobs: KLKnobs):
        self.policy, self.knobs = policy, knobs
        self.needs_inputs: tuple[str, ...] = (CONTEXT,)

    def fill(self, batch: PackedBatch, micro_batches: int) -> dict[str, float]:
        """In place (collective): two forwards of the policy, one with the contexts."""
        rows = context_rows(batch)
        has = ~torch.isnan(rows).all(1)
        g = getattr(self.policy, "groups", None)
        tp = g.tp if g is not None and g.layout.tp > 1 else None
        teacher = self_teacher_logits(self.policy, batch, rows, micro_batches)
        student = self.policy.compute_logits(batch, micro_batches)
        kl = torch.zeros(batch.num_tokens, 2, dtype=torch.float64)
        if student is not None and teacher is not None:
            chunk = getattr(getattr(self.policy, "cfg", None), "chunk_tokens", None)
            k = self.knobs.top_k
            with torch.no_grad():
                kl = torch.stack(
                    [
                        token_divergence(student, teacher, d, k, tp, chunk).double()
                        for d in ("forward", "reverse")
                    ],
                    -1,
                )
            on = broadcast_to_tokens(has, batch.cu_seqlens).to(kl.device).unsqueeze(-1)
            kl = torch.where(on, kl, torch.zeros_like(kl))
        if g is not None and g.layout.pp > 1:  # computed on the last stage
            kl = kl.to(g.device)
            dist.broadcast(kl, src=dist.get_global_rank(g.pp, g.layout.pp - 1), group=g.pp)
        batch.token_extras[KL] = kl.cpu()
        batch.extras[ON] = has.to(torch.float64)
        m = batch.loss_mask.bool() & broadcast_to_tokens(has, batch.cu_seqlens)
        return {"self_teacher/kl_mean": float(batch.token_extras[KL][m, 1].mean()) if bool(m.any()) else 0.0}


def _sc_grpo_vocab(
    batch: PackedBatch,
    direction: str = "reverse",
    power: float = 1.0,
    w_max: float = 5.0,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages times the weight of the vocabulary KL in ``direction``
    (``token_extras['self_teacher_kl']``)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"advantage.direction={direction!r}; known: {', '.join(DIRECTIONS)}")
    kk = batch.token_extras.get(KL)
    if kk is None:
        raise ValueError(f"advantage.estimator=sc_grpo_vocab needs token_extras['{KL}'] (input {KL})")
    k = kk[:, 0 if direction == "forward" else 1]
    if not power > 0 or not w_max > 0:
        raise ValueError(f"advantage.power={power} and advantage.w_max={w_max} must be > 0")
    on = batch.extras.get(ON, torch.ones(batch.num_seqs, dtype=torch.float64))
    w = sc_weights(k.double(), batch.loss_mask, batch.cu_seqlens, on, power, w_max)
    return per_token(batch, grpo(scalar_rewards(batch), batch.group_ids, scale_by_std, eps)) * w


register_provider(
    InputProvider(
        (KL,),
        "learner",
        lambda ctx, names: SelfTeacherKL(ctx.policy, ctx.knobs),
        knobs=KLKnobs,
        summary="per-token KL (full vocabulary or top-K) between the policy with and without its "
        "privileged context",
    )
)
ADVANTAGE_ESTIMATORS.add("sc_grpo_vocab", _sc_grpo_vocab, PartInfo(batch_inputs=(KL,), group_relative=True))

SPEC = MethodSpec(
    name="sc_grpo",
    summary="SC-GRPO: GRPO token advantages weighted by the KL a verified sibling in context induces",
    provenance="reconstructed",
    config={
        "advantage": {"estimator": "sc_grpo"},
        "inputs": {"self_teacher_context": {"source": "sibling", "when": "all"}},
    },
)
