"""Critic-free advantages and token/segment/step credit (method family 2).

Plain loops over groups, sequences and steps, written for reading. Per-sequence inputs are [B];
per-token inputs are padded [B, L] with a 0/1 ``mask``. SoftmaxGRPO, GEPO and PGPO are reconstructed
from their abstracts, TACO follows its authors' code, DASH its paper (arXiv 2607.00482), GiGPO its
paper (arXiv 2505.10978); each function states its provenance.
"""

from __future__ import annotations

import math

import torch

from reference.advantages import grpo


# ------------------------------------------------------------------------------------ SoftmaxGRPO
def softmax_grpo(rewards: torch.Tensor, group_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """SoftmaxGRPO advantage: A_i = G · softmax(R/τ)_i − 1 inside each group of size G.

    Σ_group A = 0, A ∈ [−1, G−1]; a group with equal rewards gets exactly 0.
    τ → 0 on binary rewards gives MaxRL (G/k − 1 on the k successes, −1 on failures);
    τ → ∞ gives τ·A → R − mean R (Dr.GRPO).
    Provenance: RECONSTRUCTED from the SoftmaxGRPO abstract and MaxRL
    (arXiv 2602.02710); the authors' formula was not available.
    rewards, group_ids: [B] -> [B]
    """
    adv = torch.zeros_like(rewards)
    for g in torch.unique(group_ids):
        sel = group_ids == g
        r = rewards[sel]
        if r.max() == r.min():
            continue
        w = torch.softmax(r / temperature, 0)
        adv[sel] = r.numel() * w - 1.0
    return adv


# ------------------------------------------------------------------------------------------- TACO
def taco_weights(
    logp: torch.Tensor, entropy: torch.Tensor, alpha: float = 0.01, lam: float = 0.9
) -> torch.Tensor:
    """TACO tail-risk token weight.

    r_tail = −ℓ − H + log α;   w = 1 if r_tail ≤ 0 else 1 − λ(1 − exp(−r_tail))     (w ∈ [1−λ, 1])
    ℓ, H: current-policy log-prob and full-vocabulary entropy, both detached.
    Provenance: CODE, xiuyilou/TACO verl/trainer/ppo/core_algos.py::compute_taco_token_advantages
    (as in the authors' code (xiuyilou/TACO)); defaults α = 0.01 (TACO_ALPHA), λ = 0.9 (TACO_LAMBDA).
    """
    out = torch.ones_like(logp)
    for idx in range(logp.numel()):
        r = -float(logp.reshape(-1)[idx]) - float(entropy.reshape(-1)[idx]) + math.log(alpha)
        if r > 0:
            out.reshape(-1)[idx] = 1.0 - lam * (1.0 - math.exp(-r))
    return out


def taco_advantages(
    adv: torch.Tensor, logp: torch.Tensor, entropy: torch.Tensor, alpha: float = 0.01, lam: float = 0.9
) -> torch.Tensor:
    """TACO credit: Ã = w·A where A > 0, A elsewhere (no gradient through w).  All [B, L]."""
    w = taco_weights(logp.detach(), entropy.detach(), alpha, lam)
    return torch.where(adv > 0, w * adv, adv).detach()


# ------------------------------------------------------------------------------------------- GEPO
def gepo_group_entropy(
    entropies: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor
) -> dict[int, float]:
    """H_g: mean entropy over every loss token of the group's rollouts.  entropies, mask: [B, L]."""
    out = {}
    for g in torch.unique(group_ids).tolist():
        sel = group_ids == g
        m = mask[sel]
        out[g] = float((entropies[sel] * m).sum() / m.sum()) if float(m.sum()) > 0 else 0.0
    return out


def gepo(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    entropies: torch.Tensor,
    mask: torch.Tensor,
    hist_mean: float | None,
    hist_sq: float | None,
    k: float = 0.5,
    beta: float = 0.9,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, float, float]:
    """GEPO: GRPO advantages with group-entropy-conditioned asymmetric attenuation.

    H_lo = μ_H − kσ_H, H_hi = μ_H + kσ_H from the history (EMA of mean and of mean square of H_g);
    H_g < H_lo and A > 0:  A ← exp(−(H_lo − H_g)/σ_H)·A
    H_g > H_hi and A < 0:  A ← exp(−(H_g − H_hi)/σ_H)·A;      otherwise A unchanged.
    The thresholds use the history *before* this batch; with no history yet (None) they use this
    batch's group entropies. Then the EMA takes this batch: μ ← βμ + (1−β)·mean_g H_g (same for H²).
    σ_H = sqrt(max(E[H²] − μ², 0)) + eps.
    Provenance: RECONSTRUCTED from the GEPO abstract; the thresholds, the EMA and
    the exponential attenuation are the spec's design, not the authors' formula.
    Returns (advantages [B], new hist_mean, new hist_sq).
    """
    hg = gepo_group_entropy(entropies, mask, group_ids)
    vals = torch.tensor(list(hg.values()), dtype=torch.float64)
    batch_mean, batch_sq = float(vals.mean()), float((vals**2).mean())
    mu, sq = (batch_mean, batch_sq) if hist_mean is None else (hist_mean, hist_sq)
    sigma = math.sqrt(max(sq - mu * mu, 0.0)) + eps
    lo, hi = mu - k * sigma, mu + k * sigma
    adv = grpo(rewards, group_ids)
    for i in range(rewards.numel()):
        h = hg[int(group_ids[i])]
        a = float(adv[i])
        if h < lo and a > 0:
            adv[i] = math.exp(-(lo - h) / sigma) * a
        elif h > hi and a < 0:
            adv[i] = math.exp(-(h - hi) / sigma) * a
    if hist_mean is None:
        new_mean, new_sq = batch_mean, batch_sq
    else:
        new_mean, new_sq = beta * hist_mean + (1 - beta) * batch_mean, beta * hist_sq + (1 - beta) * batch_sq
    return adv, new_mean, new_sq


# ------------------------------------------------------------------------------------------- DASH
def dash(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    prompt_lens: torch.Tensor,
    checkpoints: list[list[tuple[int, int]]],
    beta: float = 0.5,
    beta_drift: float = 0.5,
) -> torch.Tensor:
    """DASH segment-level credit.

    A trace is cut at its intermediate answer commitments: checkpoint k = (end_k, c_k), end_k the
    sequence position just after the token that completes answer k, c_k = 1[answer k is correct].
    Segment S_1 = [prompt_len, end_1), S_k = [end_{k−1}, end_k); tokens at or after end_K belong to S_K.
    With c_0 = 0 and d_k = c_k − c_{k−1}:
        A_t = A_i^GRPO + β(2c_k − 1) + β'·d_k       for t in S_k
    A trace with no checkpoint keeps A_i^GRPO on every token.
    Provenance: PAPER caption + RECONSTRUCTION (arXiv 2607.00482, Fig. 1): the
    segment signs come from the caption, the drift term β'd_k and the additive form are the spec's.
    mask: [B, L]; checkpoints: per sequence a list of (end position in the sequence, correct 0/1).
    """
    base = grpo(rewards, group_ids)
    B, L = mask.shape
    out = torch.zeros_like(mask, dtype=rewards.dtype)
    for i in range(B):
        cps = sorted(checkpoints[i])
        for t in range(L):
            if mask[i, t] == 0:
                continue
            a = float(base[i])
            if cps:
                k = next((j for j, (end, _) in enumerate(cps) if t < end), len(cps) - 1)
                c = cps[k][1]
                c_prev = cps[k - 1][1] if k > 0 else 0
                a += beta * (2 * c - 1) + beta_drift * (c - c_prev)
            out[i, t] = a
    return out


# ------------------------------------------------------------------------------ step-level (agents)
def _step_returns(step_rewards: list[float], gamma: float) -> list[float]:
    out, acc = [0.0] * len(step_rewards), 0.0
    for t in reversed(range(len(step_rewards))):
        acc = step_rewards[t] + gamma * acc
        out[t] = acc
    return out


def _zscore(vals: list[float], eps: float, scale_by_std: bool) -> list[float]:
    if len(vals) < 2 or max(vals) == min(vals):
        return [0.0] * len(vals)
    t = torch.tensor(vals, dtype=torch.float64)
    d = t - t.mean()
    if scale_by_std:
        d = d / (t.std(unbiased=True) + eps)
    return d.tolist()


def gigpo(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    state_keys: list[list[int]],
    step_rewards: list[list[float]],
    gamma: float = 0.95,
    omega: float = 1.0,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> list[list[float]]:
    """GiGPO per-step advantages: A_{i,t} = A^E_i + ω·A^S_{i,t}.

    A^E_i: GRPO of the episode returns R_i inside the group (no std scaling if scale_by_std=False).
    A^S: inside a group, steps whose anchor state s_{i,t} is identical form a step group; each
    step's discounted return R^γ_{i,t} = Σ_{u≥t} γ^{u−t} r_{i,u} is normalised within its step
    group (R^γ − mean)/(std + ε) (a step group of one, or of equal returns, gets 0).
    Provenance: PAPER, Feng et al. 2025 "Group-in-Group Policy Optimization for LLM Agent
    Training" (arXiv 2505.10978), episode- and step-level relative advantages with anchor-state
    grouping; defaults γ = 0.95, ω = 1 as in the paper's ALFWorld setup.
    state_keys, step_rewards: per sequence, one entry per step -> per sequence, one value per step.
    """
    ep = grpo(rewards, group_ids, scale_by_std=scale_by_std, eps=eps)
    out = [[0.0] * len(k) for k in state_keys]
    for g in torch.unique(group_ids).tolist():
        members = [i for i in range(len(state_keys)) if int(group_ids[i]) == g]
        buckets: dict[int, list[tuple[int, int, float]]] = {}
        for i in members:
            rets = _step_returns(step_rewards[i], gamma)
            for t, key in enumerate(state_keys[i]):
                buckets.setdefault(key, []).append((i, t, rets[t]))
        for items in buckets.values():
            z = _zscore([r for _, _, r in items], eps, scale_by_std)
            for (i, t, _), a in zip(items, z):
                out[i][t] = a
    return [[float(ep[i]) + omega * a for a in row] for i, row in enumerate(out)]


def pgpo(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    state_keys: list[list[int]],
    step_rewards: list[list[float]],
    gamma: float = 1.0,
    omega: float = 1.0,
    normalise: bool = True,
    eps: float = 1e-6,
) -> list[list[float]]:
    """PGPO per-step advantages from anchor-state potentials.

    G_{i,t} = Σ_{u≥t} γ^{u−t} r_{i,u};  Φ(s) = mean of G over the group's visits of state s;
    A^S_{i,t} = r_{i,t} + γ Φ(s_{i,t+1}) − Φ(s_{i,t})   (Φ after the last step = 0, the return
    is already in r);  A_{i,t} = A^E_i + ω·norm(A^S_{i,t}), norm = z-score over all steps of the
    group (normalise=False: raw A^S). A^E_i = GRPO advantage of R_i.
    With no state shared across trajectories Φ(s_{i,t}) = G_{i,t}, every A^S is 0 and PGPO = GRPO.
    Provenance: RECONSTRUCTED from the PGPO abstract on GiGPO's anchor-state grouping; the authors'
    formula was not available.
    """
    ep = grpo(rewards, group_ids, eps=eps)
    out = [[0.0] * len(k) for k in state_keys]
    for g in torch.unique(group_ids).tolist():
        members = [i for i in range(len(state_keys)) if int(group_ids[i]) == g]
        rets = {i: _step_returns(step_rewards[i], gamma) for i in members}
        visits: dict[int, list[float]] = {}
        for i in members:
            for t, key in enumerate(state_keys[i]):
                visits.setdefault(key, []).append(rets[i][t])
        phi = {key: sum(v) / len(v) for key, v in visits.items()}
        raw = []
        for i in members:
            n = len(state_keys[i])
            for t in range(n):
                nxt = phi[state_keys[i][t + 1]] if t + 1 < n else 0.0
                raw.append((i, t, step_rewards[i][t] + gamma * nxt - phi[state_keys[i][t]]))
        vals = [a for _, _, a in raw]
        z = _zscore(vals, eps, True) if normalise else vals
        for (i, t, _), a in zip(raw, z):
            out[i][t] = a
    return [[float(ep[i]) + omega * a for a in row] for i, row in enumerate(out)]


def steps_to_tokens(
    step_adv: list[list[float]],
    episode_adv: torch.Tensor,
    spans: list[list[tuple[int, int]]],
    mask: torch.Tensor,
) -> torch.Tensor:
    """Broadcast per-step advantages to the tokens of each step's span [start, end); loss tokens in
    no span get the episode advantage.  mask: [B, L] -> [B, L]."""
    out = torch.zeros_like(mask, dtype=episode_adv.dtype)
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t] == 0:
                continue
            out[i, t] = float(episode_adv[i])
            for k, (s, e) in enumerate(spans[i]):
                if s <= t < e:
                    out[i, t] = step_adv[i][k]
    return out
