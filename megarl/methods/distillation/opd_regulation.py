"""OPD regulation: the sampled-token OPD reward used as the token advantage, compressed on a log
scale and clipped (formula: reference/distillation.py ``opd_regulate``). Reconstructed: the study's
abstract names the two regulations; the formulas and defaults are ours.

    f_s(ℓ) = sign(ℓ) · s · log(1 + |ℓ|/s)          (compress; odd, monotone, |f| ≤ |ℓ|, df/dℓ(0) = 1)
    A_t = clamp(f_s(ℓ_t), −clip_low, clip_high)
"""

from __future__ import annotations

import math

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS
from megarl.batch import PackedBatch
from megarl.methods.distillation.opd_signal import Diagnostics, opd_reward, token_mean
from megarl.ops.segments import segment_sum
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo


def compress(x: torch.Tensor, scale: float) -> torch.Tensor:
    """sign(x) · s · log(1 + |x|/s), elementwise (log1p keeps it exact near 0; the bound |f| ≤ |x|
    is enforced against rounding at subnormal |x|)."""
    a = x.abs()
    return torch.sign(x) * torch.minimum(scale * torch.log1p(a / scale), a)


def regulate(
    ell: torch.Tensor, clip_low: float, clip_high: float, scale: float, compress_log: bool
) -> torch.Tensor:
    """The regulated advantage of token rewards ``ell``: compressed (when ``compress_log``), then clipped."""
    if not (clip_low >= 0 and clip_high >= 0):
        raise ValueError(f"advantage.clip_low={clip_low!r} and clip_high={clip_high!r} must be >= 0")
    if compress_log and not scale > 0:
        raise ValueError(f"advantage.scale={scale!r} must be > 0")
    a = compress(ell, scale) if compress_log else ell
    return a.clamp(-clip_low, clip_high)


def length_correlation(adv: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> float:
    """Pearson correlation of Σ_t A_t with the response length |y| over the batch's sequences (the
    length-exploitation diagnostic; 0 when either is constant)."""
    m = mask.double()
    total, length = segment_sum(adv.double() * m, cu_seqlens), segment_sum(m, cu_seqlens)
    if total.numel() < 2:
        return 0.0
    a, b = total - total.mean(), length - length.mean()
    den = math.sqrt(float((a * a).sum()) * float((b * b).sum()))
    return float((a * b).sum()) / den if den > 0 else 0.0


def opd_regulation(
    batch: PackedBatch,
    clip_low: float = 3.0,
    clip_high: float = 3.0,
    scale: float = 1.0,
    compress_log: bool = True,
    state: Diagnostics | None = None,
) -> torch.Tensor:
    """A_t = clamp(f_s(ℓ_t), −clip_low, clip_high) on the loss tokens; [T]."""
    ell = opd_reward(batch, "advantage.estimator=opd_regulation")
    m = batch.loss_mask.double()
    adv = regulate(ell, clip_low, clip_high, scale, compress_log) * m
    if state is not None:
        a = compress(ell, scale) if compress_log else ell
        clipped = (a < -clip_low) | (a > clip_high)
        state.last = {
            "opd_regulation/reward_mean": token_mean(ell, m),
            "opd_regulation/clipped_frac": token_mean(clipped.double(), m),
            "opd_regulation/length_corr": length_correlation(adv, m, batch.cu_seqlens),
            "opd_regulation/length_corr_raw": length_correlation(ell, m, batch.cu_seqlens),
        }
    return adv


ADVANTAGE_ESTIMATORS.add(
    "opd_regulation",
    opd_regulation,
    PartInfo(batch_inputs=("teacher_logprobs",), make_state=Diagnostics),
)

SPEC = MethodSpec(
    name="opd_regulation",
    summary="OPD with the token reward log-compressed and clipped as the PPO advantage",
    provenance="reconstructed",
    config={
        "advantage": {"estimator": "opd_regulation"},
        "objective": {"policy_loss": "ppo", "aggregation": "token-mean"},
    },
)
