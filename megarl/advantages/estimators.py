"""Critic-free and GAE advantage estimators, vectorised over packed sequences."""

from __future__ import annotations

import torch

from megarl.batch import PackedBatch
from megarl.ops.segments import (
    broadcast_to_tokens,
    group_all_equal,
    group_leave_one_out_mean,
    group_mean,
    group_std,
    segment_sum,
)
from megarl.registry import Registry

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage_estimator")


def scalar_rewards(batch: PackedBatch) -> torch.Tensor:
    """The batch's scalar rewards [B] in float64 (an error names a missing or vector field)."""
    if batch.rewards is None:
        raise ValueError("advantage estimation needs the batch field 'rewards'")
    if batch.rewards.dim() != 1:
        raise ValueError(
            f"field 'rewards' has shape {tuple(batch.rewards.shape)}: aggregate reward vectors to "
            "one scalar per sequence before a scalar advantage estimator"
        )
    return batch.rewards.double()


def grpo(
    rewards: torch.Tensor, group_ids: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """(R - mean_g R) / (std_g R + eps), std unbiased; [B] -> [B].

    A group whose rewards are all equal gets exactly 0 (the float mean may differ from the common
    value by an ulp, which the 1/eps scale would blow up to ~1e-11 instead of 0).
    """
    adv = rewards - group_mean(rewards, group_ids)
    if scale_by_std:
        adv = adv / (group_std(rewards, group_ids) + eps)
    return torch.where(group_all_equal(rewards, group_ids), torch.zeros_like(adv), adv)


def dr_grpo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """R - mean_g R; [B] -> [B]."""
    return grpo(rewards, group_ids, scale_by_std=False)


def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """R - mean of the other members of the group (0 for a group of one); [B] -> [B]."""
    adv = rewards - group_leave_one_out_mean(rewards, group_ids)
    return torch.where(group_all_equal(rewards, group_ids), torch.zeros_like(adv), adv)


def _compact(x: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor):
    """Gather the masked-in tokens of each sequence left-aligned into [B, N] (N = max count)."""
    B = cu_seqlens.numel() - 1
    seq = torch.repeat_interleave(torch.arange(B), cu_seqlens[1:] - cu_seqlens[:-1])
    keep = mask.bool()
    tok = keep.nonzero().flatten()
    s = seq[tok]
    counts = torch.bincount(s, minlength=B)
    N = int(counts.max()) if counts.numel() and tok.numel() else 0
    starts = torch.cumsum(counts, 0) - counts
    col = torch.arange(tok.numel()) - starts[s]
    return tok, s, col, counts, N


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the masked-in tokens of each sequence (reverse scan, vectorised over sequences).

    token_rewards, values, mask: [T]; lam: a float or one λ per sequence [B]
    -> (advantages [T], returns [T]), 0 off the mask.
    """
    tok, s, col, counts, N = _compact(token_rewards, mask, cu_seqlens)
    B = counts.numel()
    r = torch.zeros(B, N + 1, dtype=values.dtype)
    v = torch.zeros(B, N + 1, dtype=values.dtype)
    r[s, col] = token_rewards[tok].to(values.dtype)
    v[s, col] = values[tok]
    a = torch.zeros(B, N + 1, dtype=values.dtype)
    decay = gamma * torch.as_tensor(lam, dtype=values.dtype)
    for t in range(N - 1, -1, -1):
        valid = (t < counts).to(values.dtype)
        delta = r[:, t] + gamma * v[:, t + 1] - v[:, t]
        a[:, t] = (delta + decay * a[:, t + 1]) * valid
    adv = torch.zeros_like(values)
    adv[tok] = a[s, col]
    return adv, (adv + values) * mask.to(values.dtype)


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked-in entries (unbiased std), 0 off the mask; exactly 0
    when they are all equal. x, mask: [T] -> [T]."""
    v = x[mask.bool()]
    if v.numel() == 0 or bool(v.max() == v.min()):
        return torch.zeros_like(x)  # all equal: exactly 0, not ulp noise divided by eps
    std = v.std(unbiased=True) if v.numel() > 1 else torch.zeros((), dtype=x.dtype)
    return (x - v.mean()) / (std + eps) * mask.to(x.dtype)


def _last_token_rewards(batch: PackedBatch, rewards: torch.Tensor) -> torch.Tensor:
    """[T] with R_b on the last loss token of sequence b."""
    tok, s, col, counts, _ = _compact(batch.loss_mask, batch.loss_mask, batch.cu_seqlens)
    out = torch.zeros(batch.num_tokens, dtype=rewards.dtype)
    last = col == (counts[s] - 1)
    out[tok[last]] = rewards[s[last]]
    return out


def reinforce_pp(
    batch: PackedBatch, kl: torch.Tensor | None = None, kl_coef: float = 0.0, gamma: float = 1.0
) -> torch.Tensor:
    """REINFORCE++: whitened discounted return of (outcome reward at the last token - β·kl); [T]."""
    m = batch.loss_mask.double()
    r = _last_token_rewards(batch, scalar_rewards(batch))
    if kl is not None:
        r = r - kl_coef * kl.double() * m
    ret, _ = gae(r, torch.zeros_like(m), m, batch.cu_seqlens, gamma=gamma, lam=1.0)
    return whiten(ret, m)


def reinforce_pp_baseline(batch: PackedBatch) -> torch.Tensor:
    """REINFORCE++-baseline: (R - group mean) on every loss token, whitened over the batch; [T]."""
    m = batch.loss_mask.double()
    adv = broadcast_to_tokens(dr_grpo(scalar_rewards(batch), batch.group_ids), batch.cu_seqlens)
    return whiten(adv * m, m)


def per_token(batch: PackedBatch, per_seq: torch.Tensor) -> torch.Tensor:
    """Per-sequence values [B] on every loss token of their sequence; [T] (0 off the mask)."""
    return broadcast_to_tokens(per_seq, batch.cu_seqlens) * batch.loss_mask.double()


@ADVANTAGE_ESTIMATORS.register("grpo", group_relative=True)
def _grpo(batch: PackedBatch, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    return per_token(batch, grpo(scalar_rewards(batch), batch.group_ids, scale_by_std, eps))


@ADVANTAGE_ESTIMATORS.register("dr_grpo", group_relative=True)
def _dr_grpo(batch: PackedBatch) -> torch.Tensor:
    return per_token(batch, dr_grpo(scalar_rewards(batch), batch.group_ids))


@ADVANTAGE_ESTIMATORS.register("rloo", group_relative=True)
def _rloo(batch: PackedBatch) -> torch.Tensor:
    return per_token(batch, rloo(scalar_rewards(batch), batch.group_ids))


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def _reinforce_pp(batch: PackedBatch, kl_coef: float = 0.0, gamma: float = 1.0) -> torch.Tensor:
    kl = None
    if kl_coef and batch.ref_logprobs is not None and batch.old_logprobs is not None:
        kl = batch.old_logprobs.double() - batch.ref_logprobs.double()
    return reinforce_pp(batch, kl, kl_coef, gamma)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline", group_relative=True)
def _reinforce_pp_baseline(batch: PackedBatch) -> torch.Tensor:
    return reinforce_pp_baseline(batch)


def length_adaptive_lam(lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """λ_i = 1 − 1/(α·L_i) per sequence, clamped to [0, 1]: a response shorter than 1/α tokens
    (where the formula turns negative) gets λ = 0 (one-step TD), a 0-token one λ = 0. lengths: [B]."""
    if not alpha > 0:
        raise ValueError(f"advantage.lam_alpha={alpha!r} must be > 0")
    L = lengths.double()
    lam = 1.0 - 1.0 / (alpha * L.clamp(min=1.0))
    return lam.clamp(min=0.0, max=1.0)


def token_rewards(batch: PackedBatch) -> torch.Tensor:
    """The batch's per-token rewards [T] (float64): ``batch.token_rewards``, else the outcome
    reward on the last loss token of each sequence."""
    r = batch.token_rewards
    return (r if r is not None else _last_token_rewards(batch, scalar_rewards(batch))).double()


def monte_carlo_returns(batch: PackedBatch, gamma: float = 1.0) -> torch.Tensor:
    """Σ_k γ^k r_{t+k} over the loss tokens of each sequence (GAE with λ = 1, which makes the
    values cancel); [T], 0 off the mask. With γ = 1 and an outcome reward: that reward."""
    m = batch.loss_mask.double()
    ret, _ = gae(token_rewards(batch), torch.zeros_like(m), m, batch.cu_seqlens, gamma, 1.0)
    return ret


@ADVANTAGE_ESTIMATORS.register("gae", batch_inputs=("values",))
def _gae(
    batch: PackedBatch, gamma: float = 1.0, lam: float = 0.95, lam_alpha: float | None = None
) -> torch.Tensor:
    """GAE over ``batch.values``; writes ``batch.returns`` (Â + V). ``lam_alpha``: the
    length-adaptive λ of ``length_adaptive_lam`` per sequence instead of ``lam``."""
    if batch.values is None:
        raise ValueError("advantage_estimator=gae needs the batch field 'values'")
    m = batch.loss_mask.double()
    if lam_alpha is not None:
        lengths = segment_sum(m, batch.cu_seqlens)
        lam = length_adaptive_lam(lengths, lam_alpha)
    adv, ret = gae(token_rewards(batch), batch.values.double(), m, batch.cu_seqlens, gamma, lam)
    batch.returns = ret.to(batch.values.dtype)
    return adv


def compute_advantages(batch: PackedBatch, estimator: str, **knobs) -> torch.Tensor:
    """Fill ``batch.advantages`` (float32 [T]) with the named estimator and return it."""
    adv = ADVANTAGE_ESTIMATORS.get(estimator)(batch, **knobs)
    batch.advantages = adv.to(torch.float32)
    return batch.advantages
