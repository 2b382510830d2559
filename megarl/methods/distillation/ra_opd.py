"""RA-OPD: on-policy distillation on the trajectories whose distillation return agrees in sign with
the verifier (formula: reference/distillation.py ``ra_opd_keep``, ``ra_opd_advantages``).
Reconstructed from the abstract.

    D_i = Σ_t ℓ_{i,t} = log π_T(y_i|x) − log π_old(y_i|x),   c_i = +1 if R_i > threshold else −1
    m_i = 1[c_i · D_i > 0]
    A_t = m_i · ℓ_t  (or the return to go Σ_{u≥t} ℓ_u with ``returns_to_go``)

The dropped trajectories leave the loss: the estimator also clears their loss mask, so a token-mean
loss divides by Σ_i m_i |y_i| (their tokens count in no term of the step, KL and entropy included).
"""

from __future__ import annotations

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, gae
from megarl.batch import PackedBatch
from megarl.methods.distillation.opd_signal import Diagnostics, correct, opd_reward
from megarl.ops.segments import broadcast_to_tokens, segment_sum
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo


def keep(ell: torch.Tensor, cu_seqlens: torch.Tensor, is_correct: torch.Tensor) -> torch.Tensor:
    """m_i = 1[c_i · D_i > 0] from token rewards ``ell`` [T] (0 off the mask) and verdicts [B]; [B] bool."""
    d = segment_sum(ell.double(), cu_seqlens)
    return torch.where(is_correct, d > 0, d < 0)


def ra_opd(
    batch: PackedBatch,
    threshold: float = 0.0,
    returns_to_go: bool = False,
    state: Diagnostics | None = None,
) -> torch.Tensor:
    """A_t = m_i · ℓ_t (or its return to go); clears the loss mask of the dropped sequences; [T]."""
    ell = opd_reward(batch, "advantage.estimator=ra_opd")
    m = batch.loss_mask.double()
    kept = keep(ell, batch.cu_seqlens, correct(batch, threshold))
    adv = ell
    if returns_to_go:
        adv, _ = gae(ell, torch.zeros_like(ell), m, batch.cu_seqlens, 1.0, 1.0)
    kept_tok = broadcast_to_tokens(kept, batch.cu_seqlens)
    if state is not None:
        has_tokens = segment_sum(m, batch.cu_seqlens) > 0
        n = max(int(has_tokens.sum()), 1)
        ok = correct(batch, threshold)
        state.last = {
            "ra_opd/kept_frac": float((kept & has_tokens).sum()) / n,
            "ra_opd/kept_token_frac": float((m * kept_tok).sum()) / max(float(m.sum()), 1.0),
            "ra_opd/dropped_correct": float((~kept & ok & has_tokens).sum()),
            "ra_opd/dropped_incorrect": float((~kept & ~ok & has_tokens).sum()),
        }
    batch.loss_mask = torch.where(kept_tok, batch.loss_mask, torch.zeros_like(batch.loss_mask))
    return adv * m * kept_tok.double()


ADVANTAGE_ESTIMATORS.add(
    "ra_opd",
    ra_opd,
    PartInfo(batch_inputs=("teacher_logprobs",), make_state=Diagnostics),
)

SPEC = MethodSpec(
    name="ra_opd",
    summary="RA-OPD: on-policy distillation of the trajectories whose distillation return fits the verdict",
    provenance="reconstructed",
    config={
        "advantage": {"estimator": "ra_opd"},
        "objective": {"policy_loss": "ppo", "aggregation": "token-mean"},
    },
)
