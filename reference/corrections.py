"""Train/rollout mismatch corrections.

The rollout engine samples with π_roll (its own kernels, maybe another precision); the learner
recomputes π_old for the same tokens. The per-token weight w_t = exp(old_logp - rollout_logp)
corrects for the gap. Each correction returns a detached per-token multiplier c_t for the policy
loss; when no threshold triggers, every one of them equals plain IS, c_t = w_t.

  none              c = 1
  tis               c = min(w, C)                              truncated IS (Yao et al. 2025)
  mis               c = w · 1[w <= C]                          masked IS: drop tokens above the cap
  icepop            c = w · 1[α <= w <= β]                     IcePop: two-sided token filter
  seq_geo_mask      c = w · 1[lo <= ρ_b <= hi],  ρ_b = exp(mean_t log w_t)   sequence geometric-mean mask
  seq_tis           c = min(Π_t w_t, C) on every token of the sequence       sequence-level truncated IS
  token_k2|k3       c = w · 1[k_t <= C]                        token rejection on a KL estimate
  seq_{sum,mean}_{k1,k2,k3}, seq_max_{k2,k3}
                    c = w · 1[S_b <= C]   (k1: |S_b| <= C)     sequence rejection on the sum / mean /
                                                               max of k over its response tokens
  with k1 = −log w, k2 = ½ (log w)², k3 = w − 1 − log w: estimates of KL(π_roll ‖ π_old) from the
  rollout's samples. C = correction_high. Without a trigger the rejections equal plain IS and
  seq_tis equals sequence-level IS (Π_t w_t).
  rollout_correction composes them: chained criteria (a product of keep masks, each with its own
  thresholds), batch-normalised weights (c over its mean on the loss tokens of the global batch;
  over sequences for seq_tis) and "drop" (rejected tokens leave the loss mask, so every
  denominator: verl's estimator) vs "keep" (masked IS: they stay in it).
Papers: truncated IS: Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL";
IcePop: Ring-1T (inclusionAI 2025).
Provenance: the papers named above, as implemented by peers (verl rollout_corr: sequence-level
truncated IS, rejection sampling on token k2/k3 and on sequence sum/mean/max of k1/k2/k3);
thresholds are knobs, the k1 two-sided bound is ours.
"""

import torch


def is_weight(old_logp: torch.Tensor, rollout_logp: torch.Tensor) -> torch.Tensor:
    """w = exp(old_logp - rollout_logp), detached.  [B, L] -> [B, L]"""
    return torch.exp(old_logp - rollout_logp).detach()


def tis(old_logp, rollout_logp, cap: float = 2.0):
    """Truncated IS: c = min(w, C)."""
    return torch.clamp(is_weight(old_logp, rollout_logp), max=cap)


def mis(old_logp, rollout_logp, cap: float = 2.0):
    """Masked IS: c = w where w <= C, else 0."""
    w = is_weight(old_logp, rollout_logp)
    return w * (w <= cap).to(w.dtype)


def icepop(old_logp, rollout_logp, low: float = 0.5, high: float = 5.0):
    """IcePop token filter: c = w where α <= w <= β, else 0."""
    w = is_weight(old_logp, rollout_logp)
    return w * ((w >= low) & (w <= high)).to(w.dtype)


def seq_geo_mask(old_logp, rollout_logp, mask, low: float = 0.5, high: float = 2.0):
    """Sequence geometric-mean mask: keep a whole sequence (with token IS weights) when
    ρ_b = exp(mean over its response tokens of log w) lies in [lo, hi].  mask: [B, L]"""
    m = mask.to(old_logp.dtype)
    logw = (old_logp - rollout_logp).detach() * m
    rho = torch.exp(logw.sum(-1) / m.sum(-1).clamp(min=1))  # [B]
    keep = ((rho >= low) & (rho <= high)).to(old_logp.dtype).unsqueeze(-1)
    return is_weight(old_logp, rollout_logp) * keep


def seq_tis(old_logp, rollout_logp, mask, cap: float = 2.0):
    """Sequence-level truncated IS: c = min(Π_t w_t, C) over the response tokens, on every token."""
    m = mask.to(old_logp.dtype)
    rho = torch.exp(((old_logp - rollout_logp).detach() * m).sum(-1))
    return torch.clamp(rho, max=cap).unsqueeze(-1).expand_as(old_logp)


def divergence(kind: str, old_logp, rollout_logp):
    """k1 = −log w, k2 = ½ (log w)², k3 = w − 1 − log w per token (w = exp(old − roll))."""
    r = (old_logp - rollout_logp).detach()
    return {"k1": -r, "k2": 0.5 * r**2, "k3": torch.exp(r) - 1 - r}[kind]


def rejection(name: str, old_logp, rollout_logp, mask, cap: float = 2.0):
    """``token_<k>`` or ``seq_<sum|mean|max>_<k>``: c = w where the criterion is <= C, else 0."""
    return is_weight(old_logp, rollout_logp) * rejection_keep(name, old_logp, rollout_logp, mask, cap)


def rejection_keep(name: str, old_logp, rollout_logp, mask, cap: float = 2.0):
    """1 where the ``token_<k>`` / ``seq_<sum|mean|max>_<k>`` criterion is <= C, else 0 ([B, L] float)."""
    parts = name.split("_")
    k = divergence(parts[-1], old_logp, rollout_logp)
    w = is_weight(old_logp, rollout_logp)
    if parts[0] == "token":
        return (k <= cap).to(w.dtype)
    m = mask.to(old_logp.dtype)
    B = m.shape[0]
    stats = []
    for b in range(B):
        vals = k[b][m[b] > 0]
        if parts[1] == "sum":
            v = vals.sum()
        elif parts[1] == "mean":
            v = vals.mean() if vals.numel() else vals.new_zeros(())
        else:
            v = vals.max() if vals.numel() else vals.new_zeros(())
        stats.append(v.abs() if parts[-1] == "k1" else v)
    return (torch.stack(stats) <= cap).to(w.dtype).unsqueeze(-1).expand_as(w)


# ---------------------------------------------------------------- composition (chain, normalise, drop)
def keep(name: str, old_logp, rollout_logp, mask, low: float, high: float):
    """Keep mask [B, L] (float 0/1) of one rejection criterion: mis (w <= hi), icepop (lo <= w <= hi),
    seq_geo_mask (lo <= ρ_b <= hi), or a k-criterion (token_k2, seq_max_k3, ...: <= hi)."""
    w = is_weight(old_logp, rollout_logp)
    if name == "mis":
        return (w <= high).to(w.dtype)
    if name == "icepop":
        return ((w >= low) & (w <= high)).to(w.dtype)
    if name == "seq_geo_mask":
        return (seq_geo_mask(old_logp, rollout_logp, mask, low, high) > 0).to(w.dtype)
    return rejection_keep(name, old_logp, rollout_logp, mask, high)


def base(name: str, old_logp, rollout_logp, mask, low: float, high: float):
    """The single correction ``name`` (``none`` = 1)."""
    if name == "none":
        return torch.ones_like(old_logp)
    if name == "tis":
        return tis(old_logp, rollout_logp, high)
    if name == "seq_tis":
        return seq_tis(old_logp, rollout_logp, mask, high)
    return is_weight(old_logp, rollout_logp) * keep(name, old_logp, rollout_logp, mask, low, high)


def rollout_correction(
    name: str,
    old_logp,
    rollout_logp,
    mask,
    low: float = 0.5,
    high: float = 2.0,
    chain=(),
    normalise: bool = False,
    drop: bool = False,
):
    """(c, loss mask), padded [B, L]:
    K = K_name · Π_j K_j        (chain: ({"name", "high", "low"?}, ...), each with its own thresholds)
    c = base(name) · K
    drop:      m' = m · K       (rejected tokens leave every denominator; else m' = m)
    normalise: c / (Σ m' c / Σ m')       token level
               c / mean_b(Σ_t m' c / Σ_t m')  over sequences with a loss token, for seq_tis
    """
    m = mask.to(old_logp.dtype)
    c = base(name, old_logp, rollout_logp, m, low, high)
    K = torch.ones_like(old_logp)
    if name not in ("none", "tis", "seq_tis"):
        K = keep(name, old_logp, rollout_logp, m, low, high)
    for crit in chain:
        K = K * keep(crit["name"], old_logp, rollout_logp, m, crit.get("low", low), crit["high"])
    c = c * K
    m2 = m * K if drop else m
    if normalise:
        if name == "seq_tis":
            n = m2.sum(-1)
            per_seq = (c * m2).sum(-1) / n.clamp(min=1)
            mean = per_seq[n > 0].mean() if bool((n > 0).any()) else torch.ones(())
        else:
            mean = (c * m2).sum() / m2.sum() if float(m2.sum()) > 0 else torch.ones(())
        if float(mean) > 0:
            c = c / mean
    return c, m2
