"""Distilled RL: GRPO advantages redistributed over tokens by the clipped teacher/student
likelihood ratio (formula: reference/distillation.py ``distilled_rl_weights``).

    ρ_t = exp(clamp(log π_T − log π_old, −80, 80)),   ρ̄_t = clamp(ρ_t, 1/ε_ρ, ε_ρ)
    normalized: ρ̃_t = ρ̄_t / geometric mean of ρ̄ over the response's loss tokens
    w_t = ρ̃_t on the loss tokens of the selected responses (A_i > 0 with sample=positive), else 1
    A*_t = A_i · w_t

Provenance: the authors' code (``_apply_drl_importance_weight``, EasyR1-based); the weight is a
constant of the loss (no gradient to the teacher or to π_old).
"""

from __future__ import annotations

import math

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, grpo, per_token, scalar_rewards
from megarl.batch import PackedBatch
from megarl.methods.distillation.opd_signal import Diagnostics, opd_reward, token_mean
from megarl.ops.segments import broadcast_to_tokens, segment_masked_mean
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo

SAMPLES = ("positive", "negative", "all")


def distilled_rl_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seq_adv: torch.Tensor,
    rho_clip: float = 3.0,
    normalized: bool = True,
    sample: str = "positive",
) -> torch.Tensor:
    """Token weights w [T] from log π_T − log π_old [T], the loss mask [T] and A_i [B]."""
    if not rho_clip > 1.0:
        raise ValueError(
            f"advantage.rho_clip={rho_clip!r} must be > 1 (ρ is clipped to [1/rho_clip, rho_clip])"
        )
    if sample not in SAMPLES:
        raise ValueError(f"advantage.sample={sample!r}; allowed: {', '.join(SAMPLES)}")
    bound = math.log(rho_clip)
    log_rho = log_ratio.double().clamp(-80.0, 80.0).clamp(-bound, bound)  # log of the clipped ratio
    if normalized:  # geometric mean 1 over each response's loss tokens
        log_rho = log_rho - broadcast_to_tokens(segment_masked_mean(log_rho, mask, cu_seqlens), cu_seqlens)
    a = broadcast_to_tokens(seq_adv.double(), cu_seqlens)
    chosen = {"positive": a > 0, "negative": a < 0, "all": torch.ones_like(a, dtype=torch.bool)}[sample]
    return torch.where(chosen & mask.bool(), torch.exp(log_rho), torch.ones_like(log_rho))


def distilled_rl(
    batch: PackedBatch,
    rho_clip: float = 3.0,
    normalized: bool = True,
    sample: str = "positive",
    scale_by_std: bool = True,
    eps: float = 1e-6,
    state: Diagnostics | None = None,
) -> torch.Tensor:
    """A*_t = A_i · w_t on every loss token (GRPO A_i; ``scale_by_std``/``eps`` as in ``grpo``); [T]."""
    log_ratio = opd_reward(batch, "advantage.estimator=distilled_rl")
    seq_adv = grpo(scalar_rewards(batch), batch.group_ids, scale_by_std, eps)
    w = distilled_rl_weights(
        log_ratio, batch.loss_mask, batch.cu_seqlens, seq_adv, rho_clip, normalized, sample
    )
    if state is not None:
        m = batch.loss_mask.bool()
        shaped = m & (w != 1.0)
        state.last = {
            "distilled_rl/weight_mean": token_mean(w, m),
            "distilled_rl/weight_max": float(w[m].max()) if bool(m.any()) else 1.0,
            "distilled_rl/weight_min": float(w[m].min()) if bool(m.any()) else 1.0,
            "distilled_rl/shaped_frac": token_mean(shaped.double(), m),
            "distilled_rl/log_ratio_mean": token_mean(log_ratio, m),
        }
    return per_token(batch, seq_adv) * w


ADVANTAGE_ESTIMATORS.add(
    "distilled_rl",
    distilled_rl,
    PartInfo(batch_inputs=("teacher_logprobs",), make_state=Diagnostics, group_relative=True),
)

SPEC = MethodSpec(
    name="distilled_rl",
    summary="Distilled RL: GRPO advantages reweighted per token by the clipped teacher/student ratio",
    provenance="code",
    config={
        "advantage": {"estimator": "distilled_rl"},
        "objective": {"policy_loss": "ppo", "aggregation": "token-mean"},
    },
)
