"""The whole RL loss of one batch, composed from the other reference files.

    logp = token_logprobs(logits, tokens)
    ℓ_pg = policy_loss(logp, old_logp, A) · c          c: mismatch correction (1 when off)
    (correction_denominator="drop": the correction's rejected tokens leave the mask m of every term)
    L    = agg(ℓ_pg) + β_kl · agg(kl(logp, ref_logp)) - β_H · agg(H(logits)) + β_d · agg(distill)

agg is one aggregation mode for every part. This is what megarl's composed objective must equal,
on any packing, sharding and micro-batching of the same batch.
"""

import torch

from reference import aggregation, corrections, distillation, kl, logprobs, policy_losses

KL_ESTIMATORS = {"k1": kl.kl_k1, "k2": kl.kl_k2, "k3": kl.kl_k3, "k3_k2grad": kl.kl_k3_value_k2_grad}


def rl_loss(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor,
    old_logp: torch.Tensor,
    *,
    policy_loss: str = "ppo",
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    aggregation_mode: str = "token-mean",
    max_len: float | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    ref_logp: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    correction: str = "none",
    rollout_logp: torch.Tensor | None = None,
    corr_low: float = 0.5,
    corr_high: float = 2.0,
    correction_chain=(),
    correction_normalise: bool = False,
    correction_denominator: str = "keep",
    distill: str = "none",
    distill_coef: float = 0.0,
    teacher_logp: torch.Tensor | None = None,
    teacher_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Composed loss; every tensor is padded [B, L] (logits [B, L, V]). Returns a scalar."""
    logp = logprobs.token_logprobs(logits, tokens)
    if policy_loss == "ppo":
        pg = policy_losses.ppo_clip(logp, old_logp, adv, clip_low, clip_high, dual_clip)
    elif policy_loss == "gspo":
        pg = policy_losses.gspo(logp, old_logp, adv, mask, clip_low, clip_high)
    elif policy_loss == "cispo":
        pg = policy_losses.cispo(logp, old_logp, adv, clip_low, clip_high)
    elif policy_loss == "dppo_tv":
        pg = policy_losses.dppo_tv(logp, old_logp, adv, clip_low, clip_high)
    elif policy_loss == "dppo_kl":
        pg = policy_losses.dppo_kl(logp, old_logp, adv, clip_low, clip_high)
    elif policy_loss == "none":
        pg = torch.zeros_like(logp)
    else:
        raise ValueError(f"unknown policy_loss {policy_loss!r}")

    if correction != "none" or correction_chain:
        c, mask = corrections.rollout_correction(
            correction,
            old_logp,
            rollout_logp,
            mask,
            corr_low,
            corr_high,
            chain=correction_chain,
            normalise=correction_normalise,
            drop=correction_denominator == "drop",
        )
        pg = pg * c

    def agg(x):
        return aggregation.aggregate(x, mask, aggregation_mode, max_len)

    loss = agg(pg)
    if kl_coef:
        loss = loss + kl_coef * agg(KL_ESTIMATORS[kl_estimator](logp, ref_logp))
    if entropy_coef:
        loss = loss - entropy_coef * agg(logprobs.entropy(logits))
    if distill == "sampled_reverse_kl":
        loss = loss + distill_coef * agg(distillation.sampled_reverse_kl(logp, old_logp, teacher_logp))
    elif distill == "forward_kl":
        loss = loss + distill_coef * agg(distillation.forward_kl(logits, teacher_logits))
    elif distill == "reverse_kl":
        loss = loss + distill_coef * agg(distillation.reverse_kl(logits, teacher_logits))
    elif distill == "jsd":
        loss = loss + distill_coef * agg(distillation.jsd(logits, teacher_logits))
    elif distill == "hellinger":
        loss = loss + distill_coef * agg(distillation.hellinger_sq(logits, teacher_logits))
    return loss
