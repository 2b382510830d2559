"""Trust regions, clipping and regularisers (method family 1), padded [B, L], full vocabulary.

Output Reset (PPO-OR / GRPO-OR), CoKL, GAPO, ESTR, SAO strict clipping, EPPO. Every function
returns per-token losses [B, L] (masked by the caller's aggregation) unless it says otherwise.
Notation: logp = log π_θ(y_t), old_logp = log π_old(y_t), A = advantage, r = exp(logp − old_logp).

Provenance: all six papers were available as abstracts only. Each formula below is tagged
[RECON] where it is our reconstruction from the abstract; constants are knobs whose defaults are
our reconstruction's choices (docs/methods/<method>.md gives the reasoning).
"""

import math

import torch


# --------------------------------------------------------------------------- Output Reset
def output_reset(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    margin: float = math.log(1.2),
    adv_power: float = 1.0,
) -> torch.Tensor:
    """Output Reset (PPO-OR / GRPO-OR): smooth one-sided squared-margin loss in log-ratio space.

    ℓ = logp − old_logp                  rollout-relative token log-ratio
    s = sign(A)
    e = max(0, m − s·ℓ)                  OR residual: distance left to the favourable margin
    loss = ½ · w · e²,   w = |A|^p for A ≠ 0, w = 0 for A = 0
    ∂loss/∂ℓ = −w·s·e: linear in the residual, 0 at and past the margin (C¹, unlike PPO-clip).
    PPO-OR uses GAE advantages, GRPO-OR group-relative ones; the loss is the same.
    Provenance: [RECON] from the definitions in the Output Reset abstract; p and m are not
    given there: p = 1 (advantage magnitude kept), m = log(1 + 0.2) to match PPO's clip range.
    logp, old_logp, adv: [B, L] -> [B, L]
    """
    s = torch.sign(adv)
    e = torch.clamp(margin - s * (logp - old_logp), min=0.0)
    w = torch.where(adv != 0, adv.abs() ** adv_power, torch.zeros_like(adv))
    return 0.5 * w * e**2


# --------------------------------------------------------------------------- CoKL
def cokl(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    tokens: torch.Tensor,
    response_start: torch.Tensor,
    lengths: torch.Tensor,
    group_ids: torch.Tensor,
    correct: torch.Tensor,
    temperature: float = 1.0,
    length_normalise: bool = False,
    dedup: bool = True,
) -> torch.Tensor:
    """CoKL: forward KL between the correctness-conditioned reference and policy, finite-group form.

    Population [ABSTRACT]: π(y|x,C) = π(y|x)·1[y∈C] / π(C|x);
        R = KL(π_ref(·|x,C) ‖ π_θ(·|x,C)); the log π_θ(C) term cancels any uniform rescaling of the
        correct mass, so only how probability is spread over correct solutions is anchored.
    Finite group [RECON from the CoKL abstract, option A, support-restricted]:
        S_g = correct responses of group g with at least one loss token, duplicates (same response
              tokens) kept once; groups with |S_g| < 2 contribute 0
        z_i = s_i / τ,   s_i = Σ_t m·logp  (÷ n_i when length_normalise)
        q_θ = softmax_{S_g}(z^θ),  q_ref = softmax_{S_g}(z^ref)
        L_g = Σ_{i∈S_g} q_ref(i) [log q_ref(i) − log q_θ(i)]
        L   = mean of L_g over the groups with |S_g| ≥ 2 (0 when there are none)
    ∂L_g/∂s_i = (q_θ(i) − q_ref(i))/τ: zero for incorrect samples and summing to zero over S_g.
    logp, ref_logp, mask, tokens: [B, L]; response_start, lengths, group_ids: [B]; correct: [B] bool.
    Returns a scalar (a group-level term: it is not aggregated per token).
    """
    m = mask.to(logp.dtype)
    n = m.sum(-1)
    s, s_ref = (logp * m).sum(-1), (ref_logp * m).sum(-1)
    if length_normalise:
        s, s_ref = s / n.clamp(min=1), s_ref / n.clamp(min=1)
    total, active = logp.new_zeros(()), 0
    for g in torch.unique(group_ids).tolist():
        members, seen = [], set()
        for i in (group_ids == g).nonzero().flatten().tolist():
            key = tuple(tokens[i, int(response_start[i]) : int(lengths[i])].tolist())
            if bool(correct[i]) and n[i] > 0 and not (dedup and key in seen):
                members.append(i)
                seen.add(key)
        if len(members) < 2:
            continue
        idx = torch.tensor(members)
        log_q = torch.log_softmax(s[idx] / temperature, 0)
        log_q_ref = torch.log_softmax(s_ref[idx] / temperature, 0)
        total = total + (log_q_ref.exp() * (log_q_ref - log_q)).sum()
        active += 1
    return total / max(active, 1)


# --------------------------------------------------------------------------- GAPO
def gapo_clip_bounds(
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    kappa: float = 1.0,
    eps_min: float = 0.1,
    eps_max: float = 1.0,
    adapt_low: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAPO's per-rollout clip bounds, adapted to the rollout's advantage magnitude.

    a_i   = mean_t m|A_i,t|          (= |A_i| for sequence-level advantages)
    ā     = mean of a_i over the sequences with loss tokens (the whole batch)
    ε_h,i = clip(ε_h · (a_i/ā)^κ, ε_min, ε_max);  ε_l,i likewise (or ε_l when adapt_low is False)
    (a_i/ā)^κ := 1 when ā = 0.
    Provenance: [RECON] from the GAPO abstract (it keeps the PPO/GSPO surrogate and adapts only
    the clip threshold, motivated by a reverse-KL trust region; related: ETR, arXiv 2601.03723).
    adv, mask: [B, L] -> (ε_l [B], ε_h [B])
    """
    m = mask.to(adv.dtype)
    n = m.sum(-1)
    a = (adv.abs() * m).sum(-1) / n.clamp(min=1)
    has = n > 0
    abar = a[has].mean() if has.any() else a.new_zeros(())
    f = (a / abar) ** kappa if abar > 0 else torch.ones_like(a)
    hi = torch.clamp(clip_high * f, eps_min, eps_max)
    lo = torch.clamp(clip_low * f, eps_min, eps_max) if adapt_low else torch.full_like(a, clip_low)
    return lo, hi


def gapo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    kappa: float = 1.0,
    eps_min: float = 0.1,
    eps_max: float = 1.0,
    adapt_low: bool = True,
    surrogate: str = "ppo",
    dual_clip: float | None = None,
) -> torch.Tensor:
    """GAPO: PPO (or GSPO) clipped surrogate with the per-rollout bounds of gapo_clip_bounds.

    ppo:  ℓ = max(−r A, −clip(r, 1−ε_l,i, 1+ε_h,i) A)   (dual clip for A < 0 as in ppo_clip)
    gspo: the same on s_i = exp(mean_t m(logp − old_logp)), on every token of sequence i
    κ = 0 gives fixed-clip PPO/GSPO exactly (when ε_l, ε_h lie in [ε_min, ε_max]).
    Provenance: [RECON] from the GAPO abstract. logp, old_logp, adv, mask: [B, L] -> [B, L]
    """
    lo, hi = gapo_clip_bounds(adv, mask, clip_low, clip_high, kappa, eps_min, eps_max, adapt_low)
    lo, hi = lo[:, None], hi[:, None]
    if surrogate == "gspo":
        m = mask.to(logp.dtype)
        r = torch.exp(((logp - old_logp) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1))
    else:
        r = torch.exp(logp - old_logp)
    loss = torch.maximum(-r * adv, -torch.clamp(r, 1 - lo, 1 + hi) * adv)
    if dual_clip is not None and surrogate == "ppo":
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    return loss


# --------------------------------------------------------------------------- ESTR
def estr(
    logp: torch.Tensor,
    behav_logp: torch.Tensor,
    entropy: torch.Tensor,
    adv: torch.Tensor,
    eps: float = 0.5,
    kappa: float = 1.0,
    h_min: float = 0.05,
    is_cap: float = 2.0,
) -> torch.Tensor:
    """ESTR: entropy-scaled trust region for asynchronous RL (truncated-IS policy gradient).

    δ    = logp − log μ            off-policy deviation from the behaviour (rollout-engine) policy
    s(H) = max(H, H_min)^κ         the deviation's natural scale at this token's entropy
    keep = 1[|δ| ≤ ε·s(H)]          (= |δ/s(H)| ≤ ε, the entropy-scaled deviation)
    ℓ    = −keep · sg(min(e^δ, C)) · A · logp
    H is the current policy's full-vocabulary entropy (training forward), used as a statistic (no
    gradient). Provenance: [RECON] from the ESTR abstract (the abstract: the deviation is scaled by the
    local entropy before thresholding, no extra forward, no version-switch detection).
    logp, behav_logp, entropy, adv: [B, L] -> [B, L]
    """
    delta = (logp - behav_logp).detach()
    scale = torch.clamp(entropy.detach(), min=h_min) ** kappa
    keep = (delta.abs() <= eps * scale).to(logp.dtype)
    w = torch.clamp(torch.exp(delta), max=is_cap)
    return -keep * w * adv * logp


# --------------------------------------------------------------------------- SAO
def sao_clip(
    logp: torch.Tensor,
    behav_logp: torch.Tensor,
    adv: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    mask: torch.Tensor | None = None,
    max_out_of_band: float | None = None,
) -> torch.Tensor:
    """SAO's strict double-sided token clipping (single-rollout asynchronous optimisation).

    r    = exp(logp − log μ)                 μ: behaviour (rollout-engine) policy
    keep = 1[1 − ε_l ≤ r ≤ 1 + ε_h]           whatever the sign of A
    ℓ    = −sg(keep) · r · A
    Unlike PPO-clip (which keeps the gradient on the pessimistic side, e.g. r > 1+ε with A < 0),
    every out-of-band token gets exactly zero gradient. A comes from a value baseline (A = R − V,
    one rollout per prompt); the critic is another family's. Provenance: [RECON] from the SAO abstract
    (it names "strict double-sided token-level clipping").
    logp, behav_logp, adv: [B, L] -> [B, L]
    Optional sequence mask ([RECON], "a sequence-level mask when too many tokens are out of band"):
    with ρ = max_out_of_band, a sequence b whose share of out-of-band loss tokens
    Σ_t m (1 − keep) / Σ_t m exceeds ρ gets keep = 0 on every token (mask: [B, L]).
    """
    r = torch.exp(logp - behav_logp)
    keep = ((r >= 1 - clip_low) & (r <= 1 + clip_high)).to(logp.dtype).detach()
    if max_out_of_band is not None:
        m = mask.to(logp.dtype)
        for b in range(logp.shape[0]):
            n = float(m[b].sum())
            share = float(((1 - keep[b]) * m[b]).sum()) / max(n, 1.0)
            if share > max_out_of_band:
                keep[b] = 0.0
    return -keep * r * adv


# --------------------------------------------------------------------------- EPPO
def eppo_update(
    ema: torch.Tensor,
    seen: torch.Tensor,
    initial: torch.Tensor,
    task_ids: torch.Tensor,
    entropy: torch.Tensor,
    mask: torch.Tensor,
    momentum: float = 0.9,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of EPPO's per-task entropy statistics.

    μ_k   = Σ m·H / Σ m over the batch's tokens of task k (tasks with tokens in the batch)
    H̄_k  ← μ_k on a task's first batch, else momentum·H̄_k + (1 − momentum)·μ_k
    H⁰_k  = the task's first μ_k (for h_ref = "initial")
    Tasks without tokens in the batch keep their statistics; task id −1 means "no task".
    ema, seen, initial: [K]; task_ids: [B]; entropy, mask: [B, L] -> new (ema, seen, initial)
    Provenance: [RECON] from the EPPO abstract (EMA momentum 0.9).
    """
    ema, seen, initial = ema.clone(), seen.clone(), initial.clone()
    m = mask.to(torch.float64)
    for k in range(ema.numel()):
        rows = task_ids == k
        n = m[rows].sum()
        if n == 0:
            continue
        mu = (entropy.double()[rows] * m[rows]).sum() / n
        if seen[k]:
            ema[k] = momentum * ema[k] + (1 - momentum) * mu
        else:
            ema[k], initial[k], seen[k] = mu, mu, True
    return ema, seen, initial


def eppo_task_scales(
    ema: torch.Tensor,
    seen: torch.Tensor,
    initial: torch.Tensor,
    kappa: float = 1.0,
    c_min: float = 0.5,
    c_max: float = 2.0,
    h_ref: str = "mean",
) -> torch.Tensor:
    """EPPO's clip multiplier per task: c_k = clip((H̄_k / H_ref)^κ, c_min, c_max).

    H_ref = mean of H̄ over the tasks seen so far (h_ref = "mean") or the task's first batch
    entropy H⁰_k ("initial"). Unseen tasks, or H_ref ≤ 0, get 1 (the base ε).
    Over-confident (low-entropy) tasks get tighter bounds, under-explored ones looser.
    Provenance: [RECON] from the EPPO abstract (κ = 1, [c_min, c_max] = [0.5, 2]).
    [K] -> [K]
    """
    ref = initial if h_ref == "initial" else torch.full_like(ema, ema[seen].mean() if seen.any() else 0.0)
    ok = seen & (ref > 0)
    ratio = torch.where(ok, ema / torch.where(ok, ref, torch.ones_like(ref)), torch.ones_like(ema))
    return torch.where(ok, torch.clamp(ratio**kappa, c_min, c_max), torch.ones_like(ema))


def eppo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    task_ids: torch.Tensor,
    task_scales: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    adapt_low: bool = True,
    dual_clip: float | None = None,
) -> torch.Tensor:
    """EPPO: PPO clip with the bounds of each sample's task, (1 − ε_l·c_k, 1 + ε_h·c_k).

    c_k from eppo_task_scales after this step's eppo_update; samples without a task (id −1) use
    the base ε. ε_l is fixed when adapt_low is False.
    Provenance: [RECON] from the EPPO abstract. logp, old_logp, adv: [B, L]; task_ids: [B] -> [B, L]
    """
    c = torch.where(task_ids >= 0, task_scales[task_ids.clamp(min=0)], torch.ones_like(task_scales[:1]))
    c = c.to(logp.dtype)[:, None]
    lo = clip_low * c if adapt_low else torch.full_like(c, clip_low)
    r = torch.exp(logp - old_logp)
    loss = torch.maximum(-r * adv, -torch.clamp(r, 1 - lo, 1 + clip_high * c) * adv)
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    return loss
