"""Agent-family objectives in plain PyTorch: padded [B, L] tensors, full batch, no registry.

Notation: logp = log π_θ(y_t) of the current policy, m = loss mask (response tokens), n_b = Σ_t m.
"""

import math

import torch

from reference.advantages import grpo
from reference.aggregation import aggregate
from reference.logprobs import token_logprobs
from reference.policy_losses import ppo_clip

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


# ------------------------------------------------------------------ turn credit: TASPO, AgentOPSD, TRIAL
# Inputs are padded [B, L]; ``turns`` is, per sequence, the list of its assistant turns as
# (start, end) positions. A turn's eligible tokens are its loss-mask tokens; n_k counts them and a
# turn with n_k = 0 has no weight. Token advantages are A on every other loss token.


def _eligible(turns, mask: torch.Tensor) -> list[list[torch.Tensor]]:
    """Per sequence, per turn: the positions of its eligible tokens."""
    out = []
    for i, spans in enumerate(turns):
        out.append([torch.arange(s, e)[mask[i, s:e] > 0] for s, e in spans])
    return out


def mean_one_weights(w_hat: list[float], n: list[float], lo: float, hi: float) -> list[float]:
    """w_k = clip(c ŵ_k, lo, hi) with c found by bisection so that Σ n_k w_k = Σ n_k (the fixed
    point of "normalise the token-weighted mean to 1, re-clip to [lo, hi]"; lo <= 1 <= hi)."""
    N = sum(n)

    def f(c):
        return sum(nk * min(max(c * wk, lo), hi) for wk, nk in zip(w_hat, n))

    a, b = 0.0, hi / min(w_hat)  # f(0) <= N (lo <= 1); f(b) = N hi >= N
    for _ in range(200):
        mid = (a + b) / 2
        if f(mid) < N:
            a = mid
        else:
            b = mid
    c = (a + b) / 2
    return [min(max(c * wk, lo), hi) for wk in w_hat]


def _turn_weighted(adv_seq, weights, elig, mask):
    """Token advantages [B, L]: w_k A on turn k's eligible tokens, A on other loss tokens."""
    B = mask.shape[0]
    out = adv_seq[:, None].double() * mask.double()
    for i in range(B):
        for k, pos in enumerate(elig[i]):
            if pos.numel():
                out[i, pos] = weights[i][k] * float(adv_seq[i])
    return out


def taspo_weights(shift, turns, mask, sign_a, lam=0.5, w_lo=0.25, w_hi=2.0, delta=1e-6):
    """TASPO's action weights, per sequence a list (one per turn, 1 for empty turns).

    shift = ℓ^PI − ℓ^S per token. Δ_k = mean_{t∈a_k} shift_t; z_k = (Δ_k − mean Δ)/(std Δ + δ)
    (population std over the turns with tokens; z = 0 when every Δ_k is equal); ŵ_k = 1 + λ
    tanh(sign(A) z_k); w = mean_one_weights(ŵ, |a_k|, w_lo, w_hi).
    """
    elig = _eligible(turns, mask)
    out = []
    for i, pos_list in enumerate(elig):
        ks = [k for k, p in enumerate(pos_list) if p.numel()]
        w = [1.0] * len(pos_list)
        if ks:
            d = torch.tensor([float(shift[i, pos_list[k]].double().mean()) for k in ks], dtype=torch.float64)
            if bool(d.max() == d.min()):
                z = torch.zeros_like(d)
            else:
                z = (d - d.mean()) / (d.std(unbiased=False) + delta)
            w_hat = (1 + lam * torch.tanh(float(sign_a[i]) * z)).tolist()
            got = mean_one_weights(w_hat, [float(pos_list[k].numel()) for k in ks], w_lo, w_hi)
            for k, v in zip(ks, got):
                w[k] = v
        out.append(w)
    return out, elig


def taspo_advantages(
    rewards,
    group_ids,
    pi_logp,
    s_logp,
    mask,
    turns,
    lam=0.5,
    w_lo=0.25,
    w_hi=2.0,
    delta=1e-6,
    scale_by_std=True,
    eps=1e-6,
):
    """TASPO (outcome-grounded action credit from privileged supervision): token advantages [B, L].

    A = GRPO(R); the PI shift ℓ^PI − ℓ^S (the same weights with and without verified-success PI in
    context) only redistributes A over the trajectory's actions: A_t = w_{k(t)} A with positive,
    bounded ([w_lo, w_hi]), token-weighted-mean-1 weights (taspo_weights). Provenance: reconstructed
    from the abstract; λ = 0.5, bounds [0.25, 2].
    """
    adv = grpo(rewards.double(), group_ids, scale_by_std, eps)
    w, elig = taspo_weights(pi_logp - s_logp, turns, mask, torch.sign(adv), lam, w_lo, w_hi, delta)
    return _turn_weighted(adv, w, elig, mask)


def agent_opsd_beliefs(evidence: list[float], prior: float, rho=1.0, beta=1.0, prior_eps=0.05):
    """Recursive log-odds beliefs b_0..b_K: L_0 = logit(clip(p̂, ε, 1−ε)), L_k = ρ L_{k−1} + β e_k,
    b_k = σ(L_k)."""
    p = min(max(prior, prior_eps), 1 - prior_eps)
    L = math.log(p / (1 - p))
    b = [1 / (1 + math.exp(-L))]
    for e in evidence:
        L = rho * L + beta * e
        b.append(1 / (1 + math.exp(-L)))
    return b


def agent_opsd_advantages(
    rewards,
    group_ids,
    correct,
    t_logp,
    s_logp,
    mask,
    turns,
    lam=0.5,
    rho=1.0,
    beta=1.0,
    prior_eps=0.05,
    delta=1e-6,
    w_lo=0.25,
    w_hi=2.0,
    scale_by_std=True,
    eps=1e-6,
):
    """AgentOPSD (recursive Bayesian turn-level credit from self-distillation gaps): [B, L].

    Evidence e_k = Σ_{t∈T_k} (ℓ^T_t − ℓ^S_t) (teacher: the same weights with privileged context);
    prior p̂ = the group's success rate; beliefs b_k (agent_opsd_beliefs) over the turns with tokens;
    revision Δ_k = b_k − b_{k−1}; ŵ_k = 1 + λ sign(A) Δ_k / (max_k |Δ_k| + δ), then the same
    mean-one, [w_lo, w_hi]-bounded normalisation as TASPO; A_t = w_{k(t)} A. Provenance:
    reconstructed from the abstract (anchored on PBSD); λ = 0.5, ρ = β = 1, ε = 0.05.
    """
    adv = grpo(rewards.double(), group_ids, scale_by_std, eps)
    elig = _eligible(turns, mask)
    shift = (t_logp - s_logp).double()
    w = []
    for i, pos_list in enumerate(elig):
        sel = group_ids == group_ids[i]
        prior = float(correct[sel].double().mean())
        ks = [k for k, p in enumerate(pos_list) if p.numel()]
        wi = [1.0] * len(pos_list)
        if ks:
            e = [float(shift[i, pos_list[k]].sum()) for k in ks]
            b = agent_opsd_beliefs(e, prior, rho, beta, prior_eps)
            rev = [b[j + 1] - b[j] for j in range(len(ks))]
            top = max(abs(x) for x in rev)
            s = float(torch.sign(adv[i]))
            w_hat = [1 + lam * s * x / (top + delta) for x in rev]
            got = mean_one_weights(w_hat, [float(pos_list[k].numel()) for k in ks], w_lo, w_hi)
            for k, v in zip(ks, got):
                wi[k] = v
        w.append(wi)
    return _turn_weighted(adv, w, elig, mask)


def trial_multipliers(gap, turns, mask):
    """TRIAL's turn multipliers: M_k = mean_{t∈T_k} |δ_t|, m_k = M_k / (Σ_j n_j M_j / Σ_j n_j)
    (m ≡ 1 when every M_k is 0). Per sequence a list (1 for empty turns)."""
    elig = _eligible(turns, mask)
    out = []
    for i, pos_list in enumerate(elig):
        ks = [k for k, p in enumerate(pos_list) if p.numel()]
        M = {k: float(gap[i, pos_list[k]].double().abs().mean()) for k in ks}
        n = {k: float(pos_list[k].numel()) for k in ks}
        norm = sum(n[k] * M[k] for k in ks) / max(sum(n.values()), 1.0)
        out.append([M[k] / norm if k in M and norm > 0 else 1.0 for k in range(len(pos_list))])
    return out, elig


def trial_hd_per_token(logp, hind_logp, ord_logp, mask, turns):
    """TRIAL's hindsight-distillation term per token [B, L]: −m_{k(t)} · sg(δ_t) · log π_θ(y_t) on
    eligible tokens, 0 elsewhere; δ_t = ℓ^hind_t − ℓ^ord_t (the same weights with the trajectory's
    realised outcome in context, and without). Aggregated like the policy loss and added with
    weight λ: L = L_GRPO + λ L_HD. Provenance: reconstructed from the abstract.
    """
    gap = (hind_logp - ord_logp).detach().to(logp.dtype)
    m, elig = trial_multipliers(gap, turns, mask)
    coef = torch.zeros_like(logp)
    for i, pos_list in enumerate(elig):
        for k, pos in enumerate(pos_list):
            coef[i, pos] = m[i][k] * gap[i, pos]
    return -coef * logp


# ------------------------------------------------------------- Experiential Learning, ICE, SRRL
# Reconstructed (no source found; the formulas are ours). Padded [B, L] tensors; logits [B, L, V]
# aligned with tokens (logits[b, t] scores tokens[b, t]); teacher_logp: log-probabilities of the
# tokens under the policy reading a context (stop-gradient); on [B]: the sequence had a context.


def el_loss(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor,
    old_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    on: torch.Tensor,
    aggregation: str = "token-mean",
    rl_coef: float = 0.0,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> torch.Tensor:
    """Experiential Learning (LLM-as-a-Coach): on-policy context distillation from the policy
    reading the coach's knowledge k_i, a scalar.

        ℓ_t = log π^sg(y_t|x, k_i, y_<t) − log π_old(y_t|x, y_<t)
        loss_t = −sg(ℓ_t) · exp(log π_θ(y_t) − sg(log π_old(y_t)))  on samples with knowledge (on)
                 + rl_coef · PPO-clip(π_θ/π_old, A)
        loss = aggregate(loss_t, mask)

    Samples without knowledge (k = ∅) carry no distillation term.
    """
    logp = token_logprobs(logits, tokens)
    sd = -(teacher_logp - old_logp).detach() * torch.exp(logp - old_logp.detach())
    per_tok = on[:, None].to(logp.dtype) * sd
    if rl_coef:
        per_tok = per_tok + rl_coef * ppo_clip(logp, old_logp, adv, clip_low, clip_high)
    return aggregate(per_tok, mask, aggregation)


def ice_loss(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor,
    old_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    on: torch.Tensor,
    aggregation: str = "token-mean",
    sd_coef: float = 1.0,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> torch.Tensor:
    """ICE + Asymmetric-RL/SD, a scalar. Sequences are the plain prompt and a response drawn with
    an exploration instruction I_j (on: there was one); teacher_logp = log π^sg(y_t|x, I_j, y_<t).

        A_i   = the masked mean of adv over sequence i (the group advantage)
        loss_t = PPO-clip(π_θ(y_t|x)/π_old(y_t|x), A_i)
                 + sd_coef · 1[A_i > 0 and on_i] · (teacher_logp − log π_θ(y_t|x, y_<t))
        loss = aggregate(loss_t, mask)

    The second term is the sampled-token KL(π^sg(·|x, I_j) ‖ π_θ(·|x)) on tokens the conditioned
    policy drew; with no instruction anywhere the loss is PPO-clip.
    """
    logp = token_logprobs(logits, tokens)
    m = mask.to(logp.dtype)
    a = (adv * m).sum(-1) / m.sum(-1).clamp(min=1)
    pos = ((a > 0) & on.bool()).to(logp.dtype)[:, None]
    sd = teacher_logp.detach() - logp
    per_tok = ppo_clip(logp, old_logp, adv, clip_low, clip_high) + sd_coef * pos * sd
    return aggregate(per_tok, mask, aggregation)


# ------------------------------------------------------------------- SRPO, CRPO, ReflectRL
# Token-level shaping from the policy's own privileged-context forward, and reflective rollouts.
# teacher_logp = log π_θ^{sg}(y_t | x, c, y_<t) (the same weights reading a context c after the
# prompt), student_logp = log π_θ(y_t | x, y_<t) before the update, on = [B] 1 where c is non-empty.


def _grpo_seq(rewards: torch.Tensor, group_ids: torch.Tensor, scale_by_std: bool, eps: float) -> torch.Tensor:
    return grpo(rewards.double(), group_ids, scale_by_std, eps)


def srpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    teacher_logp: torch.Tensor,
    student_logp: torch.Tensor,
    mask: torch.Tensor,
    on: torch.Tensor,
    coef: float = 1.0,
    gap_clip: float = 2.0,
    with_outcome: bool = True,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """SRPO's dense token advantage [B, L] (reconstructed from the abstract).

        ℓ_t = log π^{sg}(y_t | x, p, y_<t) − log π(y_t | x, y_<t)   (p: the reflection patch; 0 where
              the sample has no patch), clipped to [−gap_clip, gap_clip] when gap_clip > 0
        A_t = A^GRPO_b + coef · ℓ_t      (with_outcome; else coef · ℓ_t alone, as in OPSD)

    on the loss tokens, 0 elsewhere. An empty patch gives ℓ ≡ 0: GRPO.
    """
    gap = (teacher_logp.double() - student_logp.double()) * on.double()[:, None]
    if gap_clip > 0:
        gap = gap.clamp(-gap_clip, gap_clip)
    base = _grpo_seq(rewards, group_ids, scale_by_std, eps)[:, None] if with_outcome else 0.0
    return (base + coef * gap) * mask.double()


def crpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    teacher_logp: torch.Tensor,
    student_logp: torch.Tensor,
    entropy: torch.Tensor,
    mask: torch.Tensor,
    turn: torch.Tensor,
    on: torch.Tensor,
    coef: float = 1.0,
    eta: float = 0.0,
    entropy_threshold: float = 0.5,
    gap_threshold: float = 1.0,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CRPO's contrastive token advantage (reconstructed; no source found): ([B, L] advantages,
    positive positions, negative positions).

        ℓ_t  = log π^{sg}(y_t | x, priv, y_<t) − log π(y_t | x, y_<t)       (on samples with a context)
        P    = {t : H_t ≥ entropy_threshold},  N = {t : H_t < entropy_threshold, |ℓ_t| ≥ gap_threshold}
        ℓ̃_t  = ℓ_t − mean{ℓ_s : s a loss token with a context, same group, same turn index}
        A_t  = A^GRPO_b + coef · (1[t∈P] ℓ̃_t − eta · 1[t∈N] ℓ̃_t)

    turn [B, L]: the assistant-turn index of each token (its k-th assistant span); positions and the
    centering count loss tokens of samples with a context only (ℓ̃ = 0 elsewhere), so Σ ℓ̃ = 0 over
    each (group, turn). eta = 0 drops the negative term, eta < 0 reverses it.
    """
    m = mask.bool() & on.bool()[:, None]
    gap = torch.where(m, teacher_logp.double() - student_logp.double(), torch.zeros((), dtype=torch.float64))
    centred = torch.zeros_like(gap)
    g2 = group_ids[:, None].expand_as(turn)
    for g in torch.unique(group_ids):
        for k in torch.unique(turn[m & (g2 == g)]):
            sel = m & (g2 == g) & (turn == k)
            centred[sel] = gap[sel] - gap[sel].mean()
    pos = m & (entropy.double() >= entropy_threshold)
    neg = m & (entropy.double() < entropy_threshold) & (gap.abs() >= gap_threshold)
    shaped = coef * (pos.double() * centred - eta * neg.double() * centred)
    base = _grpo_seq(rewards, group_ids, scale_by_std, eps)[:, None]
    return (base + shaped) * mask.double(), pos, neg


DIRECT, REFLECTIVE, TRANSFER = 0, 1, 2


def reflectrl_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    role: torch.Tensor,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """ReflectRL's per-sequence advantages [B] (reconstructed; no source found).

    role [B]: 0 direct rollout (prompt x), 1 reflective rollout (x, then the reflection context
    T(x, τ^E) built on a golden negative trajectory τ^E), 2 transfer copy (a reflective rollout's
    response under the direct context x). Direct and reflective samples get GRPO within their own
    (group, role) subgroup; a transfer copy gets max(0, (R − mean_R) / (std_R + eps)) with the mean
    and (unbiased) std of its group's reflective subgroup: only reflective successes transfer.
    """
    r = rewards.double()
    out = torch.zeros_like(r)
    for g in torch.unique(group_ids):
        for ro in (DIRECT, REFLECTIVE):
            sel = (group_ids == g) & (role == ro)
            if sel.any():
                out[sel] = _grpo_seq(r[sel], torch.zeros(int(sel.sum()), dtype=torch.long), scale_by_std, eps)
        t = (group_ids == g) & (role == TRANSFER)
        refl = r[(group_ids == g) & (role == REFLECTIVE)]
        if not t.any() or refl.numel() < 2 or bool((refl == refl[0]).all()):
            continue
        a = r[t] - refl.mean()
        if scale_by_std:
            a = a / (refl.std() + eps)
        out[t] = a.clamp(min=0)
    return out


def reflectrl_loss(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor,
    old_logp: torch.Tensor,
    reflect_logp: torch.Tensor,
    role: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    r2d_coef: float = 1.0,
    aggregation: str = "token-mean",
) -> torch.Tensor:
    """ReflectRL's loss on a padded batch [B, L] (reconstructed).

    Direct and reflective tokens: PPO clip against old_logp. Transfer tokens (role 2), the
    Reflective-to-Direct term, with w_t = π_θ(y_t | x, y_<t) / sg(π_θ(y_t | T, y_<t)) (reflect_logp:
    the same response read with the reflection context):

        L_R2D,t = r2d_coef · max(−w_t A, −clip(w_t, 1 − clip_low, 1 + clip_high) · A)

    aggregated with the objective's aggregation over every loss token.
    """
    logp = torch.log_softmax(logits.double(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    logp = logp.to(logits.dtype)
    transfer = (role == TRANSFER)[:, None].expand_as(logp)
    old = torch.where(transfer, reflect_logp.to(logp.dtype), old_logp.to(logp.dtype))
    per_tok = ppo_clip(logp, old, adv.to(logp.dtype), clip_low, clip_high)
    per_tok = torch.where(transfer, r2d_coef * per_tok, per_tok)
    return aggregate(per_tok, mask, aggregation)


def srrl_review_reward(r1: torch.Tensor, r2: torch.Tensor, reviewed: torch.Tensor) -> torch.Tensor:
    """SRRL's review reward per sample [B]: R(a_2) − R(a_1) on reviewed samples, 0 elsewhere (0
    whenever both attempts share an outcome)."""
    return (r2 - r1) * reviewed.to(r1.dtype)


def srrl_advantages(
    r1: torch.Tensor,
    r2: torch.Tensor,
    reviewed: torch.Tensor,
    group_ids: torch.Tensor,
    roles: torch.Tensor,
    mask: torch.Tensor,
    scale_by_std: bool = True,
    a2_coef: float = 0.0,
) -> torch.Tensor:
    """SRRL per-token advantages [B, L]. roles [B, L]: 1 on a_1's tokens, 2 on the review's, 3 on
    a_2's, 0 elsewhere.

        A_1,i = GRPO(r_1)_i over the group's first attempts
        A_c,i = GRPO(d)_i over the group's reviewed samples, d = srrl_review_reward (0 if not reviewed)
        A_t   = A_1 on a_1, A_c on the review, a2_coef · A_c on a_2
    """
    a1 = grpo(r1, group_ids, scale_by_std)
    ac = torch.zeros_like(a1)
    rev = reviewed.bool()
    if bool(rev.any()):
        ac[rev] = grpo(srrl_review_reward(r1, r2, reviewed)[rev], group_ids[rev], scale_by_std)
    out = torch.zeros(roles.shape, dtype=a1.dtype)
    out = torch.where(roles == 1, a1[:, None].expand_as(out), out)
    out = torch.where(roles == 2, ac[:, None].expand_as(out), out)
    out = torch.where(roles == 3, a2_coef * ac[:, None].expand_as(out), out)
    return out * mask.to(out.dtype)


def srrl_distill_set(c1: torch.Tensor, c2: torch.Tensor, reviewed: torch.Tensor) -> torch.Tensor:
    """[B] bool: the fail→success episodes (reviewed, a_1 wrong, a_2 correct)."""
    return reviewed.bool() & ~c1.bool() & c2.bool()


def srrl_loss(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor,
    old_logp: torch.Tensor,
    sd: torch.Tensor,
    aggregation: str = "token-mean",
    sd_coef: float = 1.0,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> torch.Tensor:
    """SRRL's batch loss, a scalar. The batch holds the episodes and, for every fail→success
    episode, the sequence (x, a_2) without the review context (sd [B] = 1 on those):

        loss_t = (1 − sd) · PPO-clip(π_θ/π_old, A_t) + sd · sd_coef · (−log π_θ(a_2,t | x, a_2,<t))
        loss   = aggregate(loss_t, mask)
    """
    logp = token_logprobs(logits, tokens)
    s = sd.to(logp.dtype)[:, None]
    per_tok = (1 - s) * ppo_clip(logp, old_logp, adv, clip_low, clip_high) - sd_coef * s * logp
    return aggregate(per_tok, mask, aggregation)


def srrl_memory_top_k(query: torch.Tensor, keys: torch.Tensor, k: int) -> list[int]:
    """SRRL's memory retrieval: the indices of the k stored embeddings (rows of keys [N, D], unit
    vectors) with the highest cosine similarity to query [D], ties to the lower index."""
    sims = keys @ query
    order = sorted(range(keys.shape[0]), key=lambda i: (-float(sims[i]), i))
    return order[:k]
