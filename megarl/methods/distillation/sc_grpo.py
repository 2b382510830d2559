"""SC-GRPO: GRPO whose token advantages are weighted by how much a verified sibling solution in
context changes the policy's distribution at that token. Formula and provenance:
reference/self_distillation.py (the multiplicative KL weight is the paper's; its exact form, the
per-sequence mean-1 normalisation, the clip and the sampled-token KL estimate are reconstructed).

The self-teacher (``inputs.self_teacher_context.source: sibling``) is the policy reading the prompt
with the shortest correct rollout of the same group other than the sample itself; a sample whose
group has no other correct rollout keeps w = 1 (its GRPO advantage). k_t is a sampled-token
estimate of the per-token KL between the self-conditioned and the original (old) policy, both
stop-gradient: no gradient flows through the weight.
"""

from __future__ import annotations

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, grpo, per_token, scalar_rewards
from megarl.batch import PackedBatch
from megarl.methods.distillation.self_teacher import LOGPROBS, ON
from megarl.ops.segments import broadcast_to_tokens, segment_sum
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

SPEC = MethodSpec(
    name="sc_grpo",
    summary="SC-GRPO: GRPO token advantages weighted by the KL a verified sibling in context induces",
    provenance="reconstructed",
    config={
        "advantage": {"estimator": "sc_grpo"},
        "inputs": {"self_teacher_context": {"source": "sibling", "when": "all"}},
    },
)
