"""Policy-gradient surrogate losses (per token, to be minimised, then aggregated).

Notation: logp = log π_θ(y_t), old_logp = log π_old(y_t), A = advantage, r = exp(logp - old_logp).
Every function returns per-token losses [B, L]; padding positions hold finite junk and must be
masked by the aggregation.
"""

import torch


def ppo_clip(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = None,
) -> torch.Tensor:
    """PPO clipped surrogate with asymmetric clip range (DAPO clip-higher) and optional dual clip.

    ℓ = max(-r A, -clip(r, 1-ε_low, 1+ε_high) A)
    dual clip (A < 0 only): ℓ = min(ℓ, -c A)
    Provenance: PPO (Schulman et al. 2017); clip-higher ε_high=0.28 from DAPO (Yu et al. 2025);
    dual clip from Ye et al. 2020 (c = 3 typical).
    logp, old_logp, adv: [B, L] -> [B, L]
    """
    ratio = torch.exp(logp - old_logp)
    loss = torch.maximum(-ratio * adv, -torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    return loss


def gspo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> torch.Tensor:
    """GSPO: PPO clipping on the length-normalised sequence ratio.

    s_b = exp( (1/n_b) Σ_t m (logp - old_logp) )
    ℓ_b = max(-s_b A_b, -clip(s_b, 1-ε_low, 1+ε_high) A_b), copied to every token of sequence b
    (aggregate with seq-mean-token-mean to get the paper's sequence mean).
    Provenance: GSPO (Zheng et al. 2025), sequence-level objective; defaults from the paper.
    adv is per token [B, L] and constant along a sequence (its value at each token is used).
    """
    m = mask.to(logp.dtype)
    n = m.sum(-1, keepdim=True).clamp(min=1)
    s = torch.exp(((logp - old_logp) * m).sum(-1, keepdim=True) / n)  # [B, 1]
    return torch.maximum(-s * adv, -torch.clamp(s, 1 - eps_low, 1 + eps_high) * adv)


def cispo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    eps_low: float = 1e9,
    eps_high: float = 0.28,
) -> torch.Tensor:
    """CISPO: clip the importance weight, not the update; every token keeps a gradient.

    ℓ = -sg(clip(r, 1-ε_low, 1+ε_high)) · A · logp
    Provenance: MiniMax-M1 (2025). Default: no lower clip (ε_low huge), ε_high as a knob.
    """
    ratio = torch.exp(logp - old_logp).detach()
    w = torch.clamp(ratio, max(1 - eps_low, 0.0), 1 + eps_high)
    return -w * adv * logp


def dppo_tv(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    delta_low: float = 0.2,
    delta_high: float = 0.28,
) -> torch.Tensor:
    """DPPO with a total-variation trust region on the sampled token's probability.

    p = exp(logp), p_old = exp(old_logp)
    valid = (p - p_old <= δ_high) if A > 0 else (p - p_old >= -δ_low)
    ℓ = -A · r · sg(valid)
    Provenance: authors' code (QPHutu/golden_critic, core_algos 'dppo_tv'), the code of BPCO
    (Best-Practice Critic Optimization).
    """
    p, p_old = torch.exp(logp), torch.exp(old_logp)
    valid = torch.where(adv > 0, p - p_old <= delta_high, p - p_old >= -delta_low).to(logp.dtype)
    return -adv * torch.exp(logp - old_logp) * valid.detach()


def dppo_kl(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    delta_low: float = 0.2,
    delta_high: float = 0.28,
) -> torch.Tensor:
    """DPPO with a binary-KL trust region on the sampled token.

    KL_b = p_old (log p_old - log p) + (1 - p_old) log((1 - p_old)/(1 - p))
    valid = (KL_b <= δ_high or p <= p_old) if A > 0 else (KL_b <= δ_low or p >= p_old)
    ℓ = -A · r · sg(valid)
    Provenance: authors' code (QPHutu/golden_critic, 'dppo_kl').
    """
    p, p_old = torch.exp(logp), torch.exp(old_logp)
    tiny = torch.finfo(logp.dtype).tiny
    kl_b = p_old * (old_logp - logp) + (1 - p_old) * (
        torch.log((1 - p_old).clamp(min=tiny)) - torch.log((1 - p).clamp(min=tiny))
    )
    valid = torch.where(adv > 0, (kl_b <= delta_high) | (p <= p_old), (kl_b <= delta_low) | (p >= p_old))
    return -adv * torch.exp(logp - old_logp) * valid.to(logp.dtype).detach()
