"""The peers' objective catalogue (verl's core_algos): policy losses and their advantage parts.

Padded [B, L] tensors, full batch, no registry. Notation as in reference/policy_losses.py:
logp = log π_θ(y_t), old = log π_old(y_t), roll = the rollout engine's log-prob, A = advantage,
m = loss mask, r = exp(logp - old). Every loss returns per-token losses [B, L] (to be aggregated);
padding positions hold finite junk.

Provenance: read in verl's code (volcengine/verl, verl/trainer/ppo/core_algos.py), with the paper
each function there names. Where megarl computes a statistic once per optimizer step over the whole
batch (verl: per micro-batch), the function here takes the whole batch, and says so.
"""

import torch

from reference.policy_losses import ppo_clip

# ------------------------------------------------------------------------------------------ GPG


def gpg_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, f_norm: float = 1.0) -> torch.Tensor:
    """GPG advantages: α (R − mean_g R) / f_norm, α = B / #(R ≠ 0) over the whole batch.

    A group of one has baseline 0 (its advantage is α R / f_norm), as in verl.
    Provenance: code, verl ``compute_gpg_outcome_advantage`` (GPG, Chu et al. 2025, arXiv
    2504.02546). rewards, group_ids: [B] -> [B].
    """
    B = rewards.numel()
    alpha = B / max(int((rewards != 0).sum()), 1)
    out = torch.zeros_like(rewards)
    for g in torch.unique(group_ids):
        idx = (group_ids == g).nonzero().flatten()
        base = rewards[idx].mean() if idx.numel() > 1 else torch.zeros((), dtype=rewards.dtype)
        out[idx] = alpha * (rewards[idx] - base) / f_norm
    return out


def gpg_loss(logp: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """GPG policy loss: plain policy gradient, no ratio and no clip: ℓ = −A · logp.

    Provenance: code, verl ``compute_policy_loss_gpg``. [B, L] -> [B, L]
    """
    return -adv * logp


# ----------------------------------------------------------------------------------------- GMPO


def gmpo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.4,
    eps_high: float = 0.4,
) -> torch.Tensor:
    """GMPO: the geometric mean of the token ratios, each clipped in log space.

    d_t = logp − old, d̃_t = sgn(A_t) · min(sgn(A_t) d_t, sgn(A_t) clip(d_t, −ε_low, ε_high))
    ρ_b = exp( Σ_t m d̃_t / n_b ),  Ā_b = Σ_t m A_t / n_b,  ℓ_b = −Ā_b ρ_b on every token of b
    (aggregate with seq-mean-token-mean for verl's mean over sequences).
    Provenance: code, verl ``compute_policy_loss_geo_mean`` (GMPO, Zhao et al. 2025, arXiv
    2507.20673; ε = 0.4 in log space is the paper's (e^−0.4, e^0.4)).
    """
    m = mask.to(logp.dtype)
    n = m.sum(-1).clamp(min=1)
    d = logp - old_logp
    sgn = torch.sign(adv)
    d_min = sgn * torch.minimum(sgn * d, sgn * torch.clamp(d, -eps_low, eps_high))
    ratio = torch.exp((d_min * m).sum(-1) / n)  # [B]
    a = (adv * m).sum(-1) / n
    return (-a * ratio)[:, None].expand_as(logp)


# ------------------------------------------------------------------------------ Clip-Cov, KL-Cov


def token_covariance(adv: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """cov_t = (A_t − mean A)(old_t − mean old), means over the loss tokens of the whole batch.

    verl takes the current log-probs of each micro-batch; megarl selects once per optimizer step
    on the whole batch, so with π_old's log-probs (equal to the current ones on the first update).
    The means are rounded to 2^-20, so that near-ties do not hang on the order of the sums.
    [B, L] -> [B, L] (0 off the mask).
    """
    m = mask.bool()
    a_mean, l_mean = (torch.round(x[m].mean() * 2**20) / 2**20 for x in (adv, old_logp))
    return torch.where(m, (adv - a_mean) * (old_logp - l_mean), torch.zeros_like(adv))


def clip_cov_selected(
    cov: torch.Tensor,
    mask: torch.Tensor,
    keys: torch.Tensor,
    ratio: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = 5.0,
) -> torch.Tensor:
    """Clip-Cov's tokens: candidates have cov_low < cov < cov_high; each is kept when its uniform key
    is below p = min(1, k / #candidates), k = max(⌊ratio · N⌋, 1), N = loss tokens of the batch.

    verl draws exactly min(k, #candidates) of them at random; the key rule draws k in expectation,
    and the same keys give the same tokens on any packing or split. [B, L] -> bool [B, L].
    """
    m = mask.bool()
    cand = m & (cov > cov_low) & (cov < cov_high)
    k = max(int(ratio * float(m.sum())), 1)
    p = min(1.0, k / max(int(cand.sum()), 1))
    return cand & (keys < p)


def clip_cov(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    selected: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> torch.Tensor:
    """Clip-Cov: the PPO clip loss with the selected tokens detached (their loss and gradient 0).

    ℓ = max(−rA, −clip(r, 1−ε_low, 1+ε_high) A) · (1 − sel)
    Provenance: code, verl ``compute_policy_loss_clip_cov`` (Cui et al. 2025, "The Entropy Mechanism
    of Reinforcement Learning for Reasoning Language Models", arXiv 2505.22617). verl leaves out of
    the draw tokens PPO already clips; their gradient is 0 either way, only their loss value differs.
    """
    return ppo_clip(logp, old_logp, adv, eps_low, eps_high) * (~selected).to(logp.dtype)


def kl_cov_selected(cov: torch.Tensor, mask: torch.Tensor, ratio: float = 2e-4) -> torch.Tensor:
    """KL-Cov's tokens: cov ≥ the k-th largest covariance of the batch, k = max(⌊ratio · N⌋, 1)
    (ties at the threshold are all kept). [B, L] -> bool [B, L]."""
    m = mask.bool()
    if not m.any():
        return m
    k = max(int(ratio * float(m.sum())), 1)
    tau = torch.topk(cov[m], min(k, int(m.sum()))).values[-1]
    return m & (cov >= tau)


def kl_cov(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    selected: torch.Tensor,
    kl_coef: float = 1.0,
) -> torch.Tensor:
    """KL-Cov: the unclipped surrogate, plus |logp − old| on the selected tokens.

    ℓ = −A r + β |logp − old| · sel
    Provenance: code, verl ``compute_policy_loss_kl_cov`` (Cui et al. 2025, arXiv 2505.22617).
    """
    d = logp - old_logp
    return -adv * torch.exp(d) + kl_coef * d.abs() * selected.to(logp.dtype)


# --------------------------------------------------------------------------------------- bypass


def bypass_reinforce(
    logp: torch.Tensor,
    roll_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    is_level: str = "token",
    is_threshold: float = 2.0,
) -> torch.Tensor:
    """REINFORCE on the rollout's samples, π_old = π_rollout (no recomputed old log-probs):

    ℓ = −sg(w) · A · logp, w = min(π_θ/π_roll, C) per token (``token``), per sequence as the product
    of the token ratios (``sequence``), or 1 (``none``: plain REINFORCE).
    Provenance: code, verl ``compute_policy_loss_bypass_mode`` with loss_type ``reinforce``
    (``compute_policy_loss_reinforce``, truncated IS weights).
    """
    d = (logp - roll_logp).detach()
    if is_level == "none":
        w = torch.ones_like(logp)
    elif is_level == "token":
        w = torch.clamp(torch.exp(d), max=is_threshold)
    elif is_level == "sequence":
        s = (d * mask.to(d.dtype)).sum(-1, keepdim=True)
        w = torch.clamp(torch.exp(s), max=is_threshold).expand_as(logp)
    else:
        raise ValueError(f"is_level={is_level!r}; allowed: none, token, sequence")
    return -w * adv * logp


# ------------------------------------------------------------------------- outcome advantages


def remax_advantages(rewards: torch.Tensor, baselines: torch.Tensor) -> torch.Tensor:
    """ReMax: A_i = R_i − b(prompt of i), b the reward of the prompt's greedy response.

    Provenance: code, verl ``compute_remax_outcome_advantage`` (Li et al. 2023, "ReMax", arXiv
    2310.10505), outcome rewards only. rewards, baselines: [B] -> [B].
    """
    return rewards - baselines


def opo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """OPO: A_i = R_i − Σ_g |y_j| R_j / Σ_g |y_j| (length-weighted group mean; a group of one: 0).

    Provenance: code, verl ``compute_opo_outcome_advantage`` (Hao et al. 2025, "On-Policy RL with
    Optimal Reward Baseline", arXiv 2505.23585). lengths: response tokens [B]. [B] -> [B].
    """
    out = torch.zeros_like(rewards)
    for g in torch.unique(group_ids):
        idx = (group_ids == g).nonzero().flatten()
        if idx.numel() == 1:
            out[idx] = rewards[idx]
            continue
        w = lengths[idx].to(rewards.dtype)
        # every response empty: no loss token carries the advantage, the baseline is 0
        base = (w * rewards[idx]).sum() / w.sum() if w.sum() > 0 else 0.0
        out[idx] = rewards[idx] - base
    return out


def grpo_passk_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO pass@k: only each group's best response gets an advantage, r_max − r_second (divided by
    the group's unbiased std + ε when ``scale_by_std``); every other response gets 0. Among equal
    best rewards the first is "best" (its advantage is 0 then anyway).

    Provenance: code, verl ``compute_grpo_passk_outcome_advantage`` (arXiv 2503.19595). A group of
    fewer than 2 responses is an error. [B] -> [B].
    """
    out = torch.zeros_like(rewards)
    for g in torch.unique(group_ids):
        idx = (group_ids == g).nonzero().flatten()
        r = rewards[idx]
        if r.numel() < 2:
            raise ValueError(
                f"grpo_passk needs at least 2 responses per group; group {int(g)} has {r.numel()}"
            )
        best = int(torch.argmax(r))  # first of the maxima
        second = torch.cat([r[:best], r[best + 1 :]]).max()
        a = r[best] - second
        if scale_by_std:
            a = a / (r.std() + eps)
        out[idx[best]] = a
    return out


# ------------------------------------------------------------------------------------------- KL


def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """|logp − ref_logp| (verl's ``abs`` KL penalty). [B, L] -> [B, L]"""
    return (logp - ref_logp).abs()


def kl_k1_value_k2_grad(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Value of k1 = logp − ref, gradient of k2 = (logp − ref)²/2: (logp − ref)∇logp, the unbiased
    reverse-KL gradient (verl's ``k1+``, straight-through). [B, L] -> [B, L]"""
    x = logp - ref_logp
    k2 = 0.5 * x**2
    return x.detach() + k2 - k2.detach()


class FixedKLController:
    """β stays at its initial value (verl ``FixedKLController``)."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No change."""


class AdaptiveKLController:
    """β ← β · (1 + clip(KL/target − 1, −0.2, 0.2) · n_steps / horizon) after each batch.

    Provenance: code, verl ``AdaptiveKLController`` (Ziegler et al. 2019, arXiv 1909.08593).
    """

    def __init__(self, kl_coef: float, target_kl: float, horizon: float):
        self.value, self.target, self.horizon = kl_coef, target_kl, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """One batch of ``n_steps`` sequences with mean KL ``current_kl``."""
        err = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + err * n_steps / self.horizon


def kl_in_reward(
    rewards: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    controller,
    kl=lambda logp, ref_logp: logp - ref_logp,
) -> tuple[torch.Tensor, float]:
    """KL in the reward: R' = R − β Σ_t m kl_t (β = ``controller.value``; kl: k1 unless given, on
    π_old's log-probs), then the controller sees
    the batch's KL (the mean over sequences of each sequence's token-mean KL).

    Provenance: code, verl ``apply_kl_penalty`` (token rewards − β·kl, summed by outcome
    estimators). rewards [B], the rest [B, L]. Returns (R' [B], the KL the controller saw).
    """
    m = mask.to(old_logp.dtype)
    k = kl(old_logp, ref_logp) * m
    shaped = rewards - controller.value * k.sum(-1)
    current = float((k.sum(-1) / m.sum(-1).clamp(min=1)).mean())
    controller.update(current, rewards.numel())
    return shaped, current


def optimal_token_baseline(
    rewards: torch.Tensor,
    old_logp: torch.Tensor,
    sum_pi_sq: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Optimal token baseline (outcome rewards): a baseline per group and per response position.

    w_t = 1 − 2π_t + Σ_v π_v² (π_t = exp(old_t); the squared norm of the score function),
    W_t = Σ_{j ≤ t} w_j along the response, G_t = R (the return of an outcome reward), and over the
    group's responses that have a t-th token: B_t = Σ_i G_{i,t} W_{i,t} / (Σ_i W_{i,t} + ε);
    A_t = G_t − B_t. A group of one has baseline 0. Positions count loss tokens (the k-th loss
    token of every response of a group shares B_k).
    Provenance: code, verl ``compute_optimal_token_baseline_advantage`` (no IS weights, no
    zero-tail option). rewards, group_ids [B]; the rest [B, L]. Returns [B, L] (0 off the mask).
    """
    B = rewards.numel()
    m = mask.bool()
    out = torch.zeros_like(old_logp)
    cols = [m[b].nonzero().flatten() for b in range(B)]
    W = []
    for b in range(B):
        w = 1 - 2 * torch.exp(old_logp[b, cols[b]]) + sum_pi_sq[b, cols[b]]
        W.append(torch.cumsum(w, 0))
    for g in torch.unique(group_ids):
        members = (group_ids == g).nonzero().flatten().tolist()
        for b in members:
            for k in range(len(cols[b])):
                if len(members) == 1:
                    base = 0.0
                else:
                    have = [i for i in members if len(cols[i]) > k]
                    num = sum(rewards[i] * W[i][k] for i in have)
                    den = sum(W[i][k] for i in have) + eps
                    base = num / den
                out[b, cols[b][k]] = rewards[b] - base
    return out


def dro(logp: torch.Tensor, roll_logp: torch.Tensor, adv: torch.Tensor, beta: float = 0.05) -> torch.Tensor:
    """DRO: REINFORCE on the sampler's tokens with a quadratic penalty on the log-ratio to the sampler:

    ℓ = −A · logp + ½ β (logp − roll)²
    Provenance: docs, Tinker's ``dro`` loss (Richemond et al. 2024, "Offline Regularised
    Reinforcement Learning for LLM Alignment", arXiv 2405.19107; Kimi k1.5, arXiv 2501.12599).
    [B, L] -> [B, L]
    """
    return -adv * logp + 0.5 * beta * (logp - roll_logp) ** 2
