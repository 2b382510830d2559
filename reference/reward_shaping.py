"""Reward shaping and aggregation (method family 2), plain loops for reading.

RSPO, AMRP, Rubric Dropout, CEDAR-GRPO, CARE and RRPO are reconstructed from their abstracts; the
reward floor from its paper (arXiv 2606.27291); each function states its provenance. Per-sequence
inputs are [B] or [B, K].
"""

from __future__ import annotations

import hashlib
import math

import torch

from reference.advantages import dr_grpo, grpo, rloo

BASES = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo}


# ------------------------------------------------------------------------------------------- RSPO
def rspo(
    outcome: torch.Tensor,
    process: torch.Tensor,
    group_ids: torch.Tensor,
    base: str = "grpo",
    reading: str = "A",
) -> torch.Tensor:
    """RSPO advantages (reward swap between outcome and dense process rewards).

    Reading A: per group, A = base(R^out) if the group's outcome rewards are not all equal, else
    A = base(R^proc) (the dense reward is swapped in only where the outcome carries no signal).
    Reading B: A = base(R^out) for every group (process rewards only choose which trajectories a
    group keeps: ``rspo_keep``).
    Provenance: RECONSTRUCTED from the RSPO abstract, both readings of the abstract; the swap rule of
    the paper is uncertain. outcome, process, group_ids: [B] -> [B]
    """
    fn = BASES[base]
    a_out = fn(outcome, group_ids)
    if reading == "B":
        return a_out
    a_proc = fn(process, group_ids)
    out = a_out.clone()
    for g in torch.unique(group_ids):
        sel = group_ids == g
        if outcome[sel].max() == outcome[sel].min():
            out[sel] = a_proc[sel]
    return out


def rspo_keep(process: torch.Tensor, group_ids: torch.Tensor, keep: int) -> list[int]:
    """Reading B's exploration step: in each group keep ``keep`` trajectories spread evenly over the
    ranking by process reward (rank round(j·(n−1)/(keep−1)), j = 0..keep−1; all when n ≤ keep).
    Returns the kept sequence indices in ascending order."""
    kept = []
    for g in torch.unique(group_ids).tolist():
        idx = [i for i in range(process.numel()) if int(group_ids[i]) == g]
        if len(idx) <= keep:
            kept += idx
            continue
        ranked = sorted(idx, key=lambda i: (float(process[i]), i))
        picks = {round(j * (len(idx) - 1) / (keep - 1)) for j in range(keep)} if keep > 1 else {len(idx) - 1}
        kept += [ranked[p] for p in picks]
    return sorted(kept)


# -------------------------------------------------------------------------------- reward floor
def ngram_precision(response: list, source: list, n: int = 3) -> float:
    """Fraction of the response's n-grams (with multiplicity) that occur in the source; n shrinks to
    the response length when it is shorter; an empty response has precision 0."""
    n = min(n, len(response))
    if n == 0:
        return 0.0
    src = [tuple(source[j : j + n]) for j in range(len(source) - n + 1)]
    grams = [tuple(response[j : j + n]) for j in range(len(response) - n + 1)]
    return sum(1 for gram in grams if gram in src) / len(grams)


def reward_floor(
    rewards: torch.Tensor,
    responses: list[str],
    sources: list[str],
    n: int = 3,
    threshold: float = 0.5,
    floor: float = 0.0,
) -> torch.Tensor:
    """Rule-based reward floor against verbatim copying.

    copy(y, s) = 1[ngram_precision_n(words(y), words(s)) ≥ θ];  R(y) = r_floor if copy else R_J(y)
    words: lower-cased whitespace split.
    Provenance: PAPER abstract (arXiv 2606.27291, LinkedIn: a deterministic rule-based floor for
    verbatim copying fixes judge reward hacking) + RECONSTRUCTED detector (arXiv 2606.27291).
    """
    out = rewards.clone()
    for i in range(len(responses)):
        if ngram_precision(responses[i].lower().split(), sources[i].lower().split(), n) >= threshold:
            out[i] = floor
    return out


# -------------------------------------------------------------------------------------- AMRP
def amrp_step(
    state: dict,
    rewards: torch.Tensor,
    beta: float = 0.9,
    window: int = 10,
    a: float = 1.0,
    b: float = 1.0,
    tau: float = 0.5,
    eta: float = 0.1,
    w_min: float = 0.02,
    g0: float = 0.01,
    delta: float = 1e-8,
    r_min: list | None = None,
    r_max: list | None = None,
    normalise: str = "minmax",
) -> tuple[torch.Tensor, dict]:
    """One AMRP step: update the K aggregation weights from this batch, then scalarise.

    μ_k = batch mean of dimension k;  bounds [r_min, r_max] given, or the running min/max of rewards
    s_k = (r_max − μ_k)/(r_max − r_min + δ)                              shortfall
    v_k = EMA_β|μ_k(t) − μ_k(t−1)| / (EMA_β|μ_k| + δ)                    volatility
    g_k = (μ_k(t) − μ_k(t−W'))/(W'·(r_max − r_min) + δ),  W' = min(W, steps seen); q_k = exp(−max(g_k,0)/g_0)
    z_k = s_k(1 + a·v_k + b·q_k);   w ← floor((1−η)w + η·softmax(z/τ), w_min)
    R_i = Σ_k w_k r̃_{i,k},  r̃ min-max (or z) normalised over the batch per dimension (constant → 0)
    floor: entries below w_min are set to w_min and the others rescaled to keep Σw = 1, repeated.
    EMAs start at the first value. Provenance: RECONSTRUCTED from the AMRP abstract
    (shortfall, volatility, progress); constants are the spec's defaults, g_0 is ours.
    state: {} at the start; rewards: [B, K] -> (R [B], new state)
    """
    B, K = rewards.shape
    st = {
        k: (v.clone() if isinstance(v, torch.Tensor) else list(v) if isinstance(v, list) else v)
        for k, v in state.items()
    }
    mu = torch.tensor([float(rewards[:, k].mean()) for k in range(K)], dtype=torch.float64)
    if r_min is not None:
        lo, hi = torch.tensor(r_min, dtype=torch.float64), torch.tensor(r_max, dtype=torch.float64)
    else:
        lo = torch.tensor([float(rewards[:, k].min()) for k in range(K)], dtype=torch.float64)
        hi = torch.tensor([float(rewards[:, k].max()) for k in range(K)], dtype=torch.float64)
        if "lo" in st:
            lo, hi = torch.minimum(lo, st["lo"]), torch.maximum(hi, st["hi"])
        st["lo"], st["hi"] = lo, hi
    if "w" not in st:
        st["w"] = torch.full((K,), 1.0 / K, dtype=torch.float64)
        st["hist"] = []
    if "prev" in st:
        st["ema_d"] = beta * st["ema_d"] + (1 - beta) * (mu - st["prev"]).abs()
        st["ema_m"] = beta * st["ema_m"] + (1 - beta) * mu.abs()
    else:
        st["ema_d"], st["ema_m"] = torch.zeros(K, dtype=torch.float64), mu.abs()
    rng = hi - lo
    s = [float((hi[k] - mu[k]) / (rng[k] + delta)) for k in range(K)]
    v = [float(st["ema_d"][k] / (st["ema_m"][k] + delta)) for k in range(K)]
    hist = st["hist"]
    if hist:
        lag = min(window, len(hist))
        old = hist[-lag]
        g = [float((mu[k] - old[k]) / (lag * rng[k] + delta)) for k in range(K)]
    else:
        g = [0.0] * K
    q = [math.exp(-max(gk, 0.0) / g0) for gk in g]
    z = torch.tensor([s[k] * (1 + a * v[k] + b * q[k]) for k in range(K)], dtype=torch.float64)
    w = (1 - eta) * st["w"] + eta * torch.softmax(z / tau, 0)
    st["w"] = _floor(w, w_min)
    st["prev"] = mu
    st["hist"] = (hist + [mu.tolist()])[-window:]
    norm = torch.zeros_like(rewards, dtype=torch.float64)
    for k in range(K):
        col = rewards[:, k].double()
        if col.max() == col.min():
            continue
        if normalise == "minmax":
            norm[:, k] = (col - col.min()) / (col.max() - col.min())
        else:
            norm[:, k] = (col - col.mean()) / col.std(unbiased=False)
    R = torch.tensor(
        [sum(float(st["w"][k]) * float(norm[i, k]) for k in range(K)) for i in range(B)], dtype=torch.float64
    )
    return R, st


def _floor(w: torch.Tensor, w_min: float) -> torch.Tensor:
    w = w.clone()
    fixed = torch.zeros_like(w, dtype=torch.bool)
    for _ in range(w.numel()):
        low = (w < w_min) & ~fixed
        if not bool(low.any()):
            break
        fixed |= low
        free = ~fixed
        w[fixed] = w_min
        w[free] = w[free] / w[free].sum() * (1 - w_min * int(fixed.sum()))
    return w


# ------------------------------------------------------------------------------ Rubric Dropout
def rubric_keep_mask(seed: int, step: int, prompt_uid: int, num_criteria: int, p: float) -> torch.Tensor:
    """Keep mask M_k ~ Bernoulli(1−p) for one (step, prompt), from a generator seeded by the key
    blake2b("seed:step:uid"); an all-zero mask keeps one criterion drawn uniformly from the same
    generator."""
    key = hashlib.blake2b(f"{seed}:{step}:{prompt_uid}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
    keep = torch.rand(num_criteria, generator=gen, dtype=torch.float64) >= p
    if not bool(keep.any()):
        keep[int(torch.randint(num_criteria, (1,), generator=gen))] = True
    return keep


def rubric_dropout(
    scores: torch.Tensor,
    weights: torch.Tensor,
    valid: torch.Tensor,
    prompt_uids: torch.Tensor,
    step: int,
    p: float = 0.3,
    seed: int = 0,
    train: bool = True,
    keep_pitfalls: bool = True,
) -> torch.Tensor:
    """Rubric reward with criteria dropped per (step, prompt), shared by every rollout of the prompt.

    R_i = Σ_k M_k w_k s_k(y_i) / Σ_k M_k w_k⁺    (w⁺: positive weights; negative-weight "pitfall"
    criteria are never dropped with keep_pitfalls); evaluation (train=False) uses M ≡ 1.
    Provenance: ABSTRACT + RECONSTRUCTED details from the Rubric Dropout abstract: per-(prompt, step)
    Bernoulli mask shared within the group, force-keep one, p ∈ {0.3, 0.5}.
    scores, weights: [B, K], valid: [B, K] bool (criteria of each prompt), prompt_uids: [B] -> R [B]
    """
    R = torch.zeros(scores.shape[0], dtype=torch.float64)
    for i in range(scores.shape[0]):
        ks = [k for k in range(scores.shape[1]) if bool(valid[i, k])]
        if not ks:
            continue
        if train and p > 0:
            m = rubric_keep_mask(seed, step, int(prompt_uids[i]), len(ks), p)
        else:
            m = torch.ones(len(ks), dtype=torch.bool)
        num = den = 0.0
        for j, k in enumerate(ks):
            w = float(weights[i, k])
            if bool(m[j]) or (keep_pitfalls and w < 0):
                num += w * float(scores[i, k])
                den += max(w, 0.0)
        R[i] = num / den if den > 0 else 0.0
    return R


# ------------------------------------------------------------------------------------ CEDAR-GRPO
def cedar_reward(
    correct: list[int],
    covered: list[list[int]],
    direction: list[float],
    lambda_c: float = 0.5,
    lambda_d: float = 0.5,
    gate: str = "none",
    wrong_weight: float = 0.5,
) -> torch.Tensor:
    """CEDAR composite reward.

    R = a + g(a)·(λ_c·(1/m)Σ_j covered(e_j, y) + λ_d·d(y)),   coverage 0 when there is no evidence item
    g = 1 (gate none), a (correct_only), 1 if a else wrong_weight (reduced); d clipped to [0, 1].
    Provenance: RECONSTRUCTED from the CEDAR-GRPO abstract (correctness plus abductive process
    rewards for evidence coverage and directionality); weights and gating are design choices.
    """
    out = []
    for a, cov, d in zip(correct, covered, direction):
        c = sum(cov) / len(cov) if cov else 0.0
        proc = lambda_c * c + lambda_d * min(max(d, 0.0), 1.0)
        g = {"none": 1.0, "correct_only": float(a), "reduced": 1.0 if a else wrong_weight}[gate]
        out.append(a + g * proc)
    return torch.tensor(out, dtype=torch.float64)


# ------------------------------------------------------------------------------------------ RRPO
def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a @ b) / (a.norm() * b.norm()).clamp(min=1e-12)


def rrpo_supcon_loss(pos: torch.Tensor, neg: torch.Tensor, tau: float = 0.1) -> torch.Tensor:
    """Set-contrastive loss over projected anchor embeddings (loops).

    For each positive anchor z ∈ P:  ℓ_z = −log[ Σ_{p∈P∖z} e^{sim(z,p)/τ} / Σ_{a∈(P∪N)∖z} e^{sim(z,a)/τ} ]
    L = mean_z ℓ_z, sim = cosine. Needs |P| >= 2.
    Provenance: RECONSTRUCTED from the RRPO abstract: SupCon-style set-contrastive objective; the
    abstract names a set-contrastive objective against positive/negative anchor sets.
    pos: [P, d], neg: [N, d] (already projected by f_φ) -> scalar
    """
    terms = []
    allv = torch.cat([pos, neg])
    for i in range(pos.shape[0]):
        num = [torch.exp(_cos(pos[i], pos[j]) / tau) for j in range(pos.shape[0]) if j != i]
        den = [torch.exp(_cos(pos[i], allv[j]) / tau) for j in range(allv.shape[0]) if j != i]
        terms.append(-torch.log(torch.stack(num).sum() / torch.stack(den).sum()))
    return torch.stack(terms).mean()


def rrpo_scores(resp: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """S(y) = mean_{p∈P} sim(y, p) − mean_{n∈N} sim(y, n) for projected embeddings; resp [B, d] -> [B]."""
    out = []
    for y in resp:
        sp = torch.stack([_cos(y, p) for p in pos]).mean()
        sn = (
            torch.stack([_cos(y, n) for n in neg]).mean()
            if neg.shape[0]
            else torch.zeros((), dtype=resp.dtype)
        )
        out.append(sp - sn)
    return torch.stack(out)


def rrpo_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, scale_by_std: bool = False
) -> torch.Tensor:
    """A_i = S_i − mean_group S (÷ std with scale_by_std): group-centred anchor-alignment scores.
    Provenance: ABSTRACT (group-centred scores as advantages; head frozen during policy optimisation)."""
    return grpo(scores, group_ids, scale_by_std=scale_by_std)


# ------------------------------------------------------------------------------------------ CARE
def care_reward(scores: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """R(y) = Σ_k w_k s_k(y) / Σ_k w_k  (scores [B, K] in [0, 1], weights >= 0) -> [B].
    Provenance: RECONSTRUCTED from the CARE abstract."""
    tot = sum(weights)
    return torch.tensor(
        [sum(w * float(s[k]) for k, w in enumerate(weights)) / tot if tot > 0 else 0.0 for s in scores],
        dtype=torch.float64,
    )


def care_trigger(r_best: float, r_anchor: float, pref_anchor: float) -> str:
    """Which branch evolves the rubric: ``adaptive`` when the rubric rates the best rollout at least as
    high as the anchor but the holistic judge prefers the anchor (Δ ≥ 0, P(y*≻y⁺) > 0.5: the rubric is
    hacked); ``chase`` when the best rollout still scores below the anchor (Δ < 0); else ``none``.
    Provenance: RECONSTRUCTED from the CARE abstract's Adaptive and Chase branches."""
    delta = r_best - r_anchor
    if delta >= 0 and pref_anchor > 0.5:
        return "adaptive"
    if delta < 0:
        return "chase"
    return "none"


def care_prune(variances: list[float], k_max: int, protected: int = 0) -> list[int]:
    """Indices of the criteria kept after dropping, one at a time, the least discriminative (lowest
    score variance across recent groups; ties: the older one) until at most ``k_max`` remain. The last
    ``protected`` criteria (just added, no history yet) are never dropped."""
    keep = list(range(len(variances)))
    while len(keep) > k_max:
        cands = [i for i in keep if i < len(variances) - protected]
        drop = min(cands, key=lambda i: (variances[i], i))
        keep.remove(drop)
    return keep
