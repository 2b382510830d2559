"""Agent-family objectives in plain PyTorch: padded [B, L] tensors, full batch, no registry.

Notation: logp = log π_θ(y_t) of the current policy, m = loss mask (response tokens), n_b = Σ_t m.
"""

import math

import torch

# ---------------------------------------------------------------------------------------- REGEN


def regen_weights(
    seq_logp: torch.Tensor,
    seq_logmu: torch.Tensor,
    negative: torch.Tensor,
    alpha: float = 1.0,
    clip_ratio_max: float = 10.0,
) -> torch.Tensor:
    """REGEN's per-sequence weight, a constant of the loss: [B] -> [B].

    ratio_b = exp(min(log π_b − log μ_b, log c_max)), w_b = clip(ratio_b, 0, α) on a negative
    sample, w_b = 1 on a positive one (log π_b, log μ_b: sequence log-likelihoods under the current
    and the behaviour policy).
    """
    log_ratio = torch.clamp(seq_logp.detach() - seq_logmu, max=math.log(clip_ratio_max))
    w = torch.clamp(torch.exp(log_ratio), 0.0, alpha)
    return torch.where(negative, w, torch.ones_like(w))


def regen_loss(
    logp: torch.Tensor,
    behaviour_nll: torch.Tensor,
    adv: torch.Tensor,
    negative: torch.Tensor,
    mask: torch.Tensor,
    alpha: float = 1.0,
    clip_ratio_max: float = 10.0,
    length_normalize: bool = False,
) -> torch.Tensor:
    """REGEN (offline RL on replayed expert rollouts): the batch loss, a scalar.

    logp, mask: [B, L]; behaviour_nll z_b = −log μ(y_b|x_b) (the rollout's summed NLL), adv A_b,
    negative (origin label is negative): [B].

        log π_b = Σ_t m log π_θ(y_t),  log μ_b = −z_b   (both divided by n_b if length_normalize)
        w_b     = regen_weights(log π_b, log μ_b)       (no gradient)
        loss    = mean_b ( −A_b · w_b · log π_b )   over the sequences with n_b > 0

    With every sample positive and A = 1 this is SFT (the mean over sequences of the summed NLL).
    Provenance: code, the authors' trainer (REGEN, arXiv 2607.19450): α = 1, c_max = 10,
    length_normalize off.
    """
    m = mask.to(logp.dtype)
    seq_logp = (logp * m).sum(-1)
    seq_logmu = -behaviour_nll.to(logp.dtype)
    if length_normalize:
        n = m.sum(-1).clamp(min=1)
        seq_logp, seq_logmu = seq_logp / n, seq_logmu / n
    w = regen_weights(seq_logp, seq_logmu, negative, alpha, clip_ratio_max)
    counted = m.sum(-1) > 0  # a sequence without response tokens is not a sample
    per_seq = -adv.to(logp.dtype) * w * seq_logp
    return per_seq[counted].sum() / max(int(counted.sum()), 1)
