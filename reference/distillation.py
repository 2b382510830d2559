"""On-policy distillation from a teacher.

Sampled-token reverse KL (tokens sampled from the student):
  per-token reward -(log π_s - log π_t); as an importance-weighted policy-gradient loss
  ℓ_t = -sg(teacher_logp - old_logp) · exp(logp - sg(old_logp))
  whose gradient on-policy (logp = old_logp) is (log π_s - log π_t) ∇ log π_s, the unbiased
  reverse-KL gradient estimate. Provenance: on-policy distillation (Agarwal et al. 2024, GKD;
  Thinking Machines "On-Policy Distillation" 2025).
Full-vocabulary KL per token, from student logits z_s and teacher logits z_t:
  forward  KL(π_t || π_s) = Σ_v p_t (log p_t - log p_s)
  reverse  KL(π_s || π_t) = Σ_v p_s (log p_s - log p_t)
  JSD      ½ KL(π_s || m) + ½ KL(π_t || m),  m = ½ (π_s + π_t)
  Hellinger² 1 - Σ_v sqrt(p_s p_t)
"""

import math

import torch


def sampled_reverse_kl(
    logp: torch.Tensor, old_logp: torch.Tensor, teacher_logp: torch.Tensor
) -> torch.Tensor:
    """Per-token sampled reverse-KL policy-gradient loss.  [B, L] -> [B, L]"""
    return -(teacher_logp - old_logp).detach() * torch.exp(logp - old_logp.detach())


def forward_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per token.  logits: [B, L, V] -> [B, L]"""
    ls, lt = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    return (lt.exp() * (lt - ls)).sum(-1)


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(student || teacher) per token.  logits: [B, L, V] -> [B, L]"""
    ls, lt = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    return (ls.exp() * (ls - lt)).sum(-1)


def jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence per token, ½ KL(p_s || m) + ½ KL(p_t || m), m = ½ (p_s + p_t).

    Symmetric, bounded by log 2. Provenance: the β = ½ generalised JSD of GKD (Agarwal et al. 2024).
    logits: [B, L, V] -> [B, L]
    """
    ls, lt = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    lm = torch.logaddexp(ls, lt) - math.log(2.0)
    return 0.5 * ((ls.exp() * (ls - lm)).sum(-1) + (lt.exp() * (lt - lm)).sum(-1))


def logprobs_at(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits) at arbitrary ids (e.g. a teacher's top-K).  [B, L, V], [B, L, K] -> [B, L, K]"""
    return torch.log_softmax(logits, -1).gather(-1, ids)


def hellinger_sq(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """Squared Hellinger distance H² = 1 - BC,  BC = Σ_v sqrt(p_v q_v) (Bhattacharyya coefficient).

    logits: [B, L, V] -> [B, L]
    """
    lp, lq = torch.log_softmax(logits_p, -1), torch.log_softmax(logits_q, -1)
    return 1 - torch.exp(0.5 * (lp + lq)).sum(-1)


# ----------------------------------------------------------------------------------------------
# Teacher-shaped advantages: Distilled RL, OPD regulation, RA-OPD, OPDVR / GRPD.
# Padded [B, L] tensors; ℓ = teacher_logp - old_logp is the sampled-token OPD reward (the negative
# per-token reverse-KL estimate); mask is the loss mask (0 on padding and masked-out tokens).
# ----------------------------------------------------------------------------------------------


def opd_token_reward(teacher_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ℓ_t = log π_T(y_t) − log π_old(y_t) on loss tokens, 0 elsewhere.  [B, L] -> [B, L]"""
    return (teacher_logp - old_logp) * mask


def distilled_rl_weights(
    teacher_logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    seq_adv: torch.Tensor,
    rho_clip: float = 3.0,
    normalized: bool = True,
    sample: str = "positive",
) -> torch.Tensor:
    """Distilled RL token weights (authors' code, _apply_drl_importance_weight):

      ρ_t = exp(clamp(log π_T − log π_old, −80, 80)),  ρ̄_t = clamp(ρ_t, 1/ε_ρ, ε_ρ)
      normalized: ρ̃_t = exp(log ρ̄_t − mean over the response's valid tokens of log ρ̄)
      w_t = ρ̃_t where the token is valid and the response is selected (A_i > 0 for "positive",
      A_i < 0 for "negative", every response for "all"), else 1.
    Provenance: Distilled RL (arXiv 2607.17247), code. seq_adv: [B]; others [B, L] -> [B, L]
    """
    rho = torch.exp(torch.clamp(teacher_logp - old_logp, -80.0, 80.0))
    rho = torch.clamp(rho, 1.0 / rho_clip, rho_clip)
    log_rho = torch.log(rho)
    if normalized:
        n = mask.sum(1, keepdim=True).clamp(min=1)
        log_rho = log_rho - (log_rho * mask).sum(1, keepdim=True) / n
    w = torch.ones_like(log_rho)
    for i in range(mask.shape[0]):
        a = float(seq_adv[i])
        chosen = {"positive": a > 0, "negative": a < 0, "all": True}[sample]
        if chosen:
            w[i] = torch.where(mask[i] > 0, torch.exp(log_rho[i]), torch.ones_like(w[i]))
    return w


def distilled_rl_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    teacher_logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    rho_clip: float = 3.0,
    normalized: bool = True,
    sample: str = "positive",
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """A*_t = A_i · w_t with A_i the GRPO advantage (the loss is PPO-clip on A*).  -> [B, L]"""
    from reference.advantages import grpo

    a = grpo(rewards, group_ids, scale_by_std, eps)
    w = distilled_rl_weights(teacher_logp, old_logp, mask, a, rho_clip, normalized, sample)
    return a[:, None] * w * mask


def opd_regulate(
    ell: torch.Tensor,
    clip_low: float = 3.0,
    clip_high: float = 3.0,
    scale: float = 1.0,
    compress: bool = True,
) -> torch.Tensor:
    """OPD regulation (reconstructed): log-scale compression f_s(ℓ) = sign(ℓ)·s·log(1 + |ℓ|/s),
    then clipping to [−clip_low, clip_high]. f is odd, monotone, |f(ℓ)| ≤ |ℓ|, f'(0) = 1; with
    s → ∞ and the bounds → ∞ the advantage is ℓ (plain OPD).  [B, L] -> [B, L]"""
    a = torch.sign(ell) * scale * torch.log(1 + ell.abs() / scale) if compress else ell
    return torch.clamp(a, -clip_low, clip_high)


def ra_opd_keep(ell: torch.Tensor, mask: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
    """RA-OPD (reconstructed) keep mask: D_i = Σ_t ℓ_{i,t}; keep iff c_i · D_i > 0 with c_i = +1 for a
    correct trajectory, −1 for an incorrect one.  ell, mask: [B, L]; correct: [B] bool -> [B] bool"""
    d = (ell * mask).sum(1)
    c = torch.where(correct, 1.0, -1.0).to(d.dtype)
    return c * d > 0


def ra_opd_advantages(
    ell: torch.Tensor, mask: torch.Tensor, correct: torch.Tensor, returns_to_go: bool = False
) -> torch.Tensor:
    """A_t = m_i · ℓ_t, or m_i · Σ_{u ≥ t, loss tokens} ℓ_u.  The loss divides by Σ_i m_i |y_i|: use
    ``mask * ra_opd_keep(...)[:, None]`` as the loss mask.  [B, L] -> [B, L]"""
    a = ell * mask
    if returns_to_go:
        a = torch.flip(torch.cumsum(torch.flip(a, [1]), 1), [1]) * mask
    return a * ra_opd_keep(ell, mask, correct)[:, None].to(a.dtype)


def opdvr_rewards(ell: torch.Tensor, correct: torch.Tensor, gate: str = "correctness") -> torch.Tensor:
    """OPDVR (README): r_t = max(0, ℓ_t) on a correct trajectory, −max(0, −ℓ_t) on an incorrect one,
    i.e. ℓ_t · 1[sign(ℓ_t) = c_i]; "inverse" keeps the other sides; "off" gives ℓ_t. The advantage is
    r_t itself (token_reward_direct).  ell: [B, L]; correct: [B] -> [B, L]"""
    if gate == "off":
        return ell
    keep_pos = correct if gate == "correctness" else ~correct
    pos, neg = torch.relu(ell), -torch.relu(-ell)
    return torch.where(keep_pos[:, None], pos, neg)


def grpd_rewards(
    ell: torch.Tensor,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    correct: torch.Tensor,
    gate: str = "correctness",
    scale_by_std: bool = False,
    baseline: float = 0.0,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPD (README): the OPDVR reward times |A_i| + u, A_i = R_i − mean_group R (÷ std when
    scale_by_std).  -> [B, L]"""
    from reference.advantages import grpo

    a = grpo(rewards, group_ids, scale_by_std, eps)
    return opdvr_rewards(ell, correct, gate) * (a.abs() + baseline)[:, None]


# ----------------------------------------------------------------------------------------------
# Teacher guidance where GRPO has no signal: RSTG. Reconstructed from the abstract (no public
# code): the negative zero-variance selection, the teacher-confidence weight, the token gate and
# the SFT term follow its description; the normaliser (the objective's aggregation for every term)
# is this repository's choice. Padded [B, L] tensors; per-sequence tensors [B].
# ----------------------------------------------------------------------------------------------


def top_fraction_threshold(values: torch.Tensor, frac: float) -> torch.Tensor:
    """k-th largest of the 1-D ``values``, k = ceil(frac·N); +inf when k = 0 (nothing kept)."""
    k = min(values.numel(), max(0, int(torch.ceil(torch.tensor(frac * values.numel() - 1e-9)))))
    if k == 0:
        return torch.tensor(float("inf"), dtype=torch.float64)
    return torch.sort(values.double(), descending=True).values[k - 1]


def rstg_nzv(rewards: torch.Tensor, group_ids: torch.Tensor, student: torch.Tensor, threshold: float):
    """[B] bool: the group has student samples and none is correct (reward > threshold)."""
    out = torch.zeros(rewards.shape[0], dtype=torch.bool)
    for g in group_ids.unique():
        members = group_ids == g
        s = members & student
        out[members] = bool(s.any()) and not bool((rewards[s] > threshold).any())
    return out


def rstg_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """GRPO advantages over the student samples only, 0 on teacher solutions.  [B] -> [B]"""
    from reference.advantages import grpo

    adv = torch.zeros_like(rewards, dtype=torch.float64)
    if bool(student.any()):
        adv[student] = grpo(rewards[student].double(), group_ids[student])
    return adv


def rstg_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    teacher_logp: torch.Tensor,
    entropies: torch.Tensor,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    teacher_solution: torch.Tensor,
    alpha: float = 1.0,
    gamma: float = 1.0,
    rho_entropy: float = 0.2,
    rho_divergence: float = 0.2,
    correct_threshold: float = 0.5,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    aggregation: str = "token-mean",
) -> torch.Tensor:
    """RSTG [reconstructed]: L = agg( PPO-clip(A)·[student]
                                  + α c_i M_t (−sg(ℓ_t) exp(logp − sg old))
                                  − γ [correct teacher solution of an NZV group] logp ).

    NZV: groups whose student samples are all wrong. c_i = exp(mean_t log π_T) on NZV student
    samples (0 elsewhere). ℓ_t = log π_T − log π_old. M_t = H_t ≥ θ_H or |ℓ_t| ≥ θ_D, θ the k-th
    largest over the loss tokens of every NZV student sample, k = ceil(ρ·N).
    logp, old_logp, adv, mask, teacher_logp, entropies: [B, L]; rewards, group_ids, teacher_solution: [B].
    """
    from reference.aggregation import aggregate
    from reference.policy_losses import ppo_clip

    student = ~teacher_solution.bool()
    correct = rewards > correct_threshold
    nzv = rstg_nzv(rewards, group_ids, student, correct_threshold)
    n = mask.sum(1)
    conf = torch.exp((teacher_logp.double() * mask).sum(1) / n.clamp(min=1))
    weight = torch.where(nzv & student & (n > 0), conf, torch.zeros_like(conf))
    sft = (nzv & ~student & correct).to(logp.dtype)
    pool = (mask > 0) & (weight > 0)[:, None]
    div = (teacher_logp - old_logp).abs()
    gate = (entropies >= top_fraction_threshold(entropies[pool], rho_entropy)) | (
        div >= top_fraction_threshold(div[pool], rho_divergence)
    )
    pg = ppo_clip(logp, old_logp, adv, clip_low, clip_high, dual_clip) * student[:, None]
    opd = -(teacher_logp - old_logp).detach() * torch.exp(logp - old_logp.detach())
    tok = pg + alpha * weight[:, None].to(logp.dtype) * gate * opd - gamma * sft[:, None] * logp
    return aggregate(tok, mask, aggregation)


def rstg_teacher_solutions(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    solution_rewards: torch.Tensor,
    solution_groups: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """[S] bool: which sampled teacher solutions join the batch: their group's student samples
    (``rewards``, ``group_ids``: [B], no teacher solutions among them) are all wrong (NZV) and the
    solution itself is correct (reward > threshold). Reconstructed: the abstract's "SFT on
    teacher-correct solutions" of the prompts RSTG selects."""
    nzv = rstg_nzv(rewards, group_ids, torch.ones_like(group_ids, dtype=torch.bool), threshold)
    bad = set(group_ids[nzv].tolist())
    in_nzv = torch.tensor([int(g) in bad for g in solution_groups.tolist()], dtype=torch.bool)
    return in_nzv & (solution_rewards > threshold)


# ----------------------------------------------------------------------------------------------
# Self-Routing: one route per prompt group by its samples' correctness and confidence.
# Reconstructed from the abstract (four routes: GRPO / self-distillation / regularise / skip); the
# confidence, thresholds, route losses and the normaliser are this reconstruction's.
# ----------------------------------------------------------------------------------------------

SELF_ROUTES = ("grpo", "opsd", "regularise", "skip")


def self_routing_routes(
    correct: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    tau_c: float = 0.8,
) -> torch.Tensor:
    """[B] route index into SELF_ROUTES: p̂ = mean correct of the group, c̄ = mean of
    c_i = exp(mean_t log π_old); 0 < p̂ < 1 grpo, p̂ = 0 opsd, p̂ = 1 and c̄ < τ_c regularise, else skip.
    correct, group_ids: [B]; old_logp, mask: [B, L]."""
    conf = torch.exp((old_logp.double() * mask).sum(1) / mask.sum(1).clamp(min=1))
    out = torch.zeros(correct.shape[0], dtype=torch.long)
    for g in group_ids.unique():
        members = group_ids == g
        p = float(correct[members].double().mean())
        if 0 < p < 1:
            out[members] = 0
        elif p == 0:
            out[members] = 1
        else:
            out[members] = 3 if float(conf[members].mean()) >= tau_c else 2
    return out


def self_routing_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    teacher_logp: torch.Tensor,
    teacher_on: torch.Tensor,
    routes: torch.Tensor,
    sd_coef: float = 1.0,
    reg_coef: float = 0.1,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    aggregation: str = "token-mean",
) -> torch.Tensor:
    """Self-Routing [reconstructed]: per token, by its group's route,
        grpo:        PPO-clip(r, A)
        opsd:        λ_SD · (−sg(log π_T − log π_old) · exp(logp − sg old))   (T: the self-teacher)
        regularise:  λ_reg · (−logp)
        skip:        0
    summed and divided by the tokens (token-mean) or sequences with a loss token (seq-mean-token-mean:
    of per-sequence token means; seq-mean-token-sum: of per-sequence sums) of the non-skipped routes.
    logp, old_logp, adv, mask, teacher_logp: [B, L]; teacher_on (1: the sample has a teacher
    context), routes: [B]."""
    from reference.policy_losses import ppo_clip

    r = routes[:, None]
    pg = ppo_clip(logp, old_logp, adv, clip_low, clip_high, dual_clip)
    sd = -(teacher_logp - old_logp).detach() * torch.exp(logp - old_logp.detach()) * teacher_on[:, None]
    zero = torch.zeros_like(logp)
    tok = torch.where(r == 0, pg, zero) + torch.where(r == 1, sd_coef * sd, zero)
    tok = tok + torch.where(r == 2, -reg_coef * logp, zero)
    keep = (routes != 3)[:, None].to(logp.dtype) * mask
    n = mask.sum(1)
    if aggregation == "token-mean":
        return (tok * keep).sum() / keep.sum().clamp(min=1)
    seqs = (keep.sum(1) > 0).to(logp.dtype)
    per_seq = (tok * keep).sum(1)
    if aggregation == "seq-mean-token-mean":
        per_seq = per_seq / n.clamp(min=1)
    elif aggregation != "seq-mean-token-sum":
        raise ValueError(f"self_routing_loss: unsupported aggregation {aggregation!r}")
    return (per_seq * seqs).sum() / seqs.sum().clamp(min=1)


# ----------------------------------------------------------------------------------------------
# TIDE: token-level independent deficit-excess correction. Provenance: the authors' code
# (yzc-666/TIDE, verl/verl/utils/tide_reward.py and its CPU tests), on-policy distillation on
# padded [B, L] tensors with the teacher's top-K [B, L, K]:
#   a_t = log p_T(o_t) - log q_old(o_t)
#   h(a) = 2 (exp(min(a/2, 60)) - 1) = 2 (sqrt(p/q) - 1)                 (bounded below by -2)
#   p̄_t = softmax of the teacher's K top logprobs (renormalised over the top-K)
#   d_t = max(0, Σ_{v∈TopK} p̄_t(v) (log p̄_t(v) - log q_old(v)))       (student not renormalised)
#   τ⁻ = Quantile_{1-ρ⁻}([-a]_+), A⁻ = {valid t: [-a_t]_+ >= τ⁻, a_t < 0}
#   τ⁺ = Quantile_{1-ρ⁺}(d),      A⁺ = {valid t: d_t >= τ⁺}   (ρ = 0: none; ρ = 1: all valid tokens)
#   slots: the sampled token with A = h(a_t)·1[A⁻], each top-K id v with A = λ p̄_t(v)·1[A⁺], each
#   through the PPO clip surrogate max(-r A, -clip(r, 1-ε_l, 1+ε_h) A), r = q_θ / q_old per slot;
#   ℓ_t = Σ_slots (on-policy: -[excess_t log q_θ(o_t) + Σ_v deficit_{t,v} log q_θ(v)] in gradient).
# ----------------------------------------------------------------------------------------------


def tide_h(a: torch.Tensor) -> torch.Tensor:
    """Bounded Hellinger excess shaping h(a) = 2(exp(a/2) - 1), a/2 clamped at 60."""
    return 2.0 * torch.expm1(torch.clamp(a / 2, max=60.0))


def tide_deficit(teacher_topk_logp: torch.Tensor, student_topk_logp: torch.Tensor) -> torch.Tensor:
    """d_t = max(0, Σ_v p̄(v)(log p̄(v) - log q(v))) over the teacher's top-K.  [B, L, K] x2 -> [B, L]"""
    lbar = torch.log_softmax(teacher_topk_logp, -1)
    pbar = lbar.exp()
    terms = torch.where(pbar > 0, pbar * (lbar - student_topk_logp), torch.zeros_like(pbar))
    return torch.clamp(terms.sum(-1), min=0.0)


def tide_threshold(x: torch.Tensor, rho: float) -> torch.Tensor:
    """Quantile_{1-ρ}(x) (torch.quantile, linear); +inf for ρ = 0 or no values, -inf for ρ = 1."""
    if rho <= 0 or x.numel() == 0:
        return torch.tensor(math.inf, dtype=torch.float64)
    if rho >= 1:
        return torch.tensor(-math.inf, dtype=torch.float64)
    return torch.quantile(x.double(), 1.0 - rho)


def tide_gates(a: torch.Tensor, d: torch.Tensor, mask: torch.Tensor, rho_minus: float, rho_plus: float):
    """(A⁻, A⁺) as [B, L] bool over the valid (mask) tokens of the whole batch."""
    valid = mask > 0
    neg = torch.clamp(-a.double(), min=0.0)
    tau_m = tide_threshold(neg[valid], rho_minus)
    tau_p = tide_threshold(d.double()[valid], rho_plus)
    return valid & (neg >= tau_m) & (a < 0), valid & (d.double() >= tau_p)


def tide_loss(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    old_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    topk_ids: torch.Tensor,
    teacher_topk_logp: torch.Tensor,
    student_topk_old: torch.Tensor,
    mask: torch.Tensor,
    rho_minus: float = 0.2,
    rho_plus: float = 0.2,
    lam: float = 1.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> torch.Tensor:
    """Per-token TIDE loss ℓ_t [B, L] (to aggregate with the run's aggregation).

    logits [B, L, V]; tokens, old_logp, teacher_logp, mask [B, L]; topk_ids, teacher_topk_logp,
    student_topk_old (the behaviour policy's logprobs at the teacher's top-K ids) [B, L, K]."""
    logq = torch.log_softmax(logits, -1)
    logp = logq.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    lq_k = logq.gather(-1, topk_ids.clamp(min=0))
    a = (teacher_logp - old_logp).detach()
    d = tide_deficit(teacher_topk_logp, student_topk_old)
    in_minus, in_plus = tide_gates(a, d, mask, rho_minus, rho_plus)
    excess = (tide_h(a) * in_minus).to(logp.dtype)
    deficit = (lam * torch.softmax(teacher_topk_logp, -1) * in_plus.unsqueeze(-1)).to(logp.dtype)

    def slot(r, adv):
        return torch.maximum(-r * adv, -torch.clamp(r, 1 - clip_low, 1 + clip_high) * adv)

    sampled = slot(torch.exp(logp - old_logp.detach()), excess)
    injected = slot(torch.exp(lq_k - student_topk_old.detach()), deficit).sum(-1)
    return sampled + injected


# ----------------------------------------------------------------------------------------------
# SKALD: an annealed, exponentially tilted teacher cross-entropy behind a per-prompt gate.
# Reconstructed from the abstract (the tilt that down-weights teacher-preferred tokens of very low
# student likelihood, the annealing to the teacher cross-entropy, the gate on a positive teacher
# advantage); the tilt's form, the linear schedule and the gates are this reconstruction's.
# ----------------------------------------------------------------------------------------------


def skald_beta(step: int, beta0: float, anneal_steps: int) -> float:
    """β_t = β_0 · max(0, 1 − t / T_anneal); β_0 throughout when T_anneal = 0."""
    return float(beta0) if anneal_steps <= 0 else float(beta0) * max(0.0, 1.0 - step / anneal_steps)


def skald_tilted_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float
) -> torch.Tensor:
    """L_β = −Σ_v w_β(v) log p_S(v),  w_β(v) = q_T(v) p_S(v)^β / Σ_u q_T(u) p_S(u)^β  (w stop-grad).

    β = 0: the teacher cross-entropy −Σ q_T log p_S (gradient p_S − q_T w.r.t. the logits).
    logits: [B, L, V] -> [B, L]"""
    ls = torch.log_softmax(student_logits, -1)
    lt = torch.log_softmax(teacher_logits, -1)
    w = torch.softmax((lt + beta * ls).detach(), -1)
    return -(w * ls).sum(-1)


def skald_topk_loss(
    student_logits: torch.Tensor, ids: torch.Tensor, teacher_topk_logp: torch.Tensor, beta: float
) -> torch.Tensor:
    """L_β over the teacher's top-K ids: q̄_T = softmax of the teacher's K logprobs, log p_S at the ids,
    w_k = softmax_k(log q̄_T(k) + β log p_S(k)) (stop-grad), L = −Σ_k w_k log p_S(k).
    student_logits [B, L, V], ids and teacher_topk_logp [B, L, K] -> [B, L]"""
    ls = torch.log_softmax(student_logits, -1).gather(-1, ids)
    w = torch.softmax((torch.log_softmax(teacher_topk_logp, -1) + beta * ls).detach(), -1)
    return -(w * ls).sum(-1)


def skald_gate(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    mode: str = "zero_variance",
    teacher_acc: torch.Tensor | None = None,
    margin: float = 0.0,
    correct_threshold: float = 0.5,
) -> torch.Tensor:
    """[B] 1.0 where the sample's prompt is distilled. teacher_advantage: teacher_acc − (fraction of
    the group's samples with reward > threshold) > margin; zero_variance: the group's rewards are all
    equal; always: 1."""
    out = torch.zeros(rewards.shape[0], dtype=torch.float64)
    for g in group_ids.unique():
        m = group_ids == g
        if mode == "always":
            out[m] = 1.0
        elif mode == "zero_variance":
            out[m] = float(bool((rewards[m] == rewards[m][0]).all()))
        else:
            assert teacher_acc is not None
            acc = float((rewards[m] > correct_threshold).double().mean())
            out[m] = ((teacher_acc[m].double() - acc) > margin).double()
    return out


def skald_card_accuracy(rewards: torch.Tensor, threshold: float) -> torch.Tensor:
    """[G, k] rewards of k rollouts per prompt of the policy reading the prompt's skill card ->
    [G] the teacher's accuracy acc(teacher-context rollouts), the first term of Â_T.
    Reconstructed (the abstract's "verified rollouts show a positive teacher advantage")."""
    return (rewards > threshold).double().mean(1)


def skald_skill_card(cards: dict, task: str, answer: str):
    """The card shown with a prompt: the task's card (else the ``*`` card), None when there is none
    or the prompt's stripped, non-empty answer occurs in it (the explicit-answer filter).
    Reconstructed: one card per task is the abstraction, the substring test the filter."""
    card = cards.get(task, cards.get("*"))
    if card is None or (answer.strip() and answer.strip() in card):
        return None
    return card


# ----------------------------------------------------------------------------------------------
# GeoSD: geometric self-distillation. Reconstructed (no source found; the Hellinger pieces match
# TIDE's code). Per position, full vocabulary, from the student's logits z_θ, the privileged-context
# self-teacher's logits z_T (same weights, stop-gradient) and a lagged checkpoint's z_ck:
#   BC(p, q)   = Σ_v sqrt(p_v q_v),   H²(p, q) = 1 - BC ∈ [0, 1]
#   d_FR(q, r) = 2 arccos(BC(q, r)) ∈ [0, π]    (d_FR² = 8(1 - BC) for BC > 1 - 1e-7: arccos's
#                                                gradient is infinite at 1)
#   ℓ_t        = H²(p_T, q_θ) + β d_FR(q_θ, q_ck)²
# ----------------------------------------------------------------------------------------------


def bhattacharyya(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """BC = Σ_v sqrt(p_v q_v).  logits: [..., V] -> [...]"""
    lp, lq = torch.log_softmax(logits_p, -1), torch.log_softmax(logits_q, -1)
    return torch.exp(0.5 * (lp + lq)).sum(-1)


def fisher_rao_sq(logits_q: torch.Tensor, logits_r: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """Squared Fisher-Rao distance (2 arccos BC)² of two categoricals; for BC > 1 - eps (arccos's
    gradient blows up at 1) its expansion 8(1 - BC), so it is 0 with zero gradient at q = r.
    [..., V] -> [...]"""
    bc = bhattacharyya(logits_q, logits_r)
    far = (2.0 * torch.arccos(torch.clamp(bc, max=1.0 - eps))) ** 2
    return torch.where(bc > 1.0 - eps, 8.0 * (1.0 - bc), far)


def geosd_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, ck_logits: torch.Tensor, beta: float = 0.1
) -> torch.Tensor:
    """Per-token GeoSD loss H²(p_T, q_θ) + β d_FR(q_θ, q_ck)² (teacher and checkpoint detached).
    logits: [B, L, V] -> [B, L]"""
    h2 = hellinger_sq(teacher_logits.detach(), student_logits)
    return h2 + beta * fisher_rao_sq(student_logits, ck_logits.detach())


def geosd_natural_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    ck_logits: torch.Tensor,
    beta: float = 0.1,
    damping: float = 1e-3,
) -> torch.Tensor:
    """Per-token GeoSD loss with the output-space natural-gradient step: the value of ``geosd_loss``,
    and a logits gradient ĝ = (diag(q) − q qᵀ + λI)^{-1} g per token, g the autograd gradient of
    ``geosd_loss``, solved densely. Reconstructed (GeoSD's "natural gradient in sqrt(q)-space mapped
    back through the logits", damped by λ). logits: [B, L, V] -> [B, L]"""
    z = student_logits.detach().requires_grad_(True)
    (g,) = torch.autograd.grad(geosd_loss(z, teacher_logits, ck_logits, beta).sum(), z)
    q = torch.softmax(student_logits.detach().double(), -1)
    eye = torch.eye(q.shape[-1], dtype=q.dtype)
    fisher = torch.diag_embed(q) - q.unsqueeze(-1) * q.unsqueeze(-2) + damping * eye
    nat = torch.linalg.solve(fisher, g.double().unsqueeze(-1)).squeeze(-1).to(student_logits.dtype)
    value = geosd_loss(student_logits.detach(), teacher_logits, ck_logits, beta)
    part = (student_logits * nat).sum(-1)
    return value + part - part.detach()
