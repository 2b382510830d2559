"""Gradient-level methods (method family 7): exact per-sample gradients, sketches and the formulas
built on them, in plain PyTorch loops written for reading.

GUPO (group weights from gradient agreement) and GCPO (updates projected off the principal singular
subspaces of the pretrained weights, and the principal-subspace overlap) are RECONSTRUCTED from
their abstracts; the authors' formulas were not available. Each function states its provenance.
"""

from __future__ import annotations

import torch


# ------------------------------------------------------------------------------------ gradients
def exact_gradients(losses: list[torch.Tensor], params: list[torch.Tensor]) -> torch.Tensor:
    """``[N, P]``: the gradient of each of ``losses`` w.r.t. ``params``, flattened and concatenated,
    one backward per loss (the exact per-sample / per-group reference)."""
    rows = []
    for loss in losses:
        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        rows.append(
            torch.cat(
                [(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)]
            )
        )
    return torch.stack(rows)


def kronecker_sketch(grad: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """JL sketch ``left @ grad @ rightᵀ`` of a weight gradient [m, n] (left: [r, m], right: [r', n]);
    with N(0, 1/r) and N(0, 1/r') entries, E <sketch(G), sketch(H)> = <G, H>."""
    return left @ grad @ right.T


# ------------------------------------------------------------------------------------ GUPO
def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = float(a.norm()), float(b.norm())
    return float(a @ b) / (na * nb) if na > 0 and nb > 0 else 0.0


def gupo_weights(
    vectors: torch.Tensor, group_ids: torch.Tensor, evidence: str = "rollout_agreement"
) -> tuple[torch.Tensor, torch.Tensor]:
    """GUPO group weights and uncertainties from per-rollout gradient vectors ``[B, D]`` (exact or
    sketched) and ``group_ids`` [B]; groups in order of ``torch.unique(group_ids)``.

    rollout_agreement: consensus c = mean over groups with a gradient of the group mean;
        e+_q = sum_i max(0, cos(g_qi, c)), e-_q = sum_i max(0, -cos(g_qi, c)); Dirichlet
        alpha = (e+ + 1, e- + 1), S = e+ + e- + 2; weight ∝ belief e+ / S; uncertainty 2 / S.
    group_dispersion: mu_q = mean_i g_qi, s2_q = mean_i |g_qi - mu_q|², c_{-q} = mean of the other
        groups' mu; e_q = G_q max(0, cos(mu_q, c_{-q})) / (1 + s2_q / |mu_q|²); alpha = (e + 1, 1),
        S = e + 2; weight ∝ 1 - 2 / S; uncertainty 2 / S.
    Weights are rescaled to mean 1 over the groups with a nonzero gradient; the others get 1, and
    all get 1 when every weight is 0.
    Provenance: RECONSTRUCTED from the GUPO abstract (Dirichlet-based uncertainty of each group's
    gradient, reliability weighting instead of plain averaging).
    """
    groups = torch.unique(group_ids).tolist()
    members = [[i for i in range(len(group_ids)) if int(group_ids[i]) == g] for g in groups]
    v = vectors.double()
    means = [v[m].mean(0) for m in members]
    active = [any(float(v[i].norm()) > 0 for i in m) for m in members]
    raw, unc = [], []
    if evidence == "rollout_agreement":
        live = [mu for mu, a in zip(means, active) if a]
        consensus = torch.stack(live).mean(0) if live else torch.stack(means).mean(0)
        for m in members:
            pos = sum(max(0.0, _cos(v[i], consensus)) for i in m)
            neg = sum(max(0.0, -_cos(v[i], consensus)) for i in m)
            s = pos + neg + 2.0
            raw.append(pos / s)
            unc.append(2.0 / s)
    elif evidence == "group_dispersion":
        n_act = sum(active)
        for q, m in enumerate(members):
            mu = means[q]
            spread = sum(float((v[i] - mu).pow(2).sum()) for i in m) / len(m)
            others = [means[p] for p in range(len(members)) if p != q and active[p]]
            agree = max(0.0, _cos(mu, torch.stack(others).mean(0))) if n_act > 1 and others else 1.0
            m2 = float(mu.pow(2).sum())
            e = len(m) * agree / (1.0 + spread / m2) if m2 > 0 else 0.0
            raw.append(e / (e + 2.0))
            unc.append(2.0 / (e + 2.0))
    else:
        raise ValueError(f"evidence={evidence!r}")
    total = sum(r for r, a in zip(raw, active) if a)
    n_act = sum(active)
    w = [r * n_act / total if (a and total > 0) else 1.0 for r, a in zip(raw, active)]
    return torch.tensor(w, dtype=torch.float64), torch.tensor(unc, dtype=torch.float64)


def weighted_update(group_grads: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """GUPO's update direction ``sum_q w_q g_q`` from exact group gradients ``[Q, P]``."""
    return (weights.double()[:, None] * group_grads.double()).sum(0)


# ------------------------------------------------------------------------------------ GCPO
def principal_bases(weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(U_k [m, k], V_k [n, k]): the top-``rank`` left and right singular vectors of a pretrained
    weight [m, n] (float64 SVD)."""
    U, _, Vh = torch.linalg.svd(weight.double(), full_matrices=False)
    return U[:, :rank], Vh[:rank].T


def gcpo_project(update: torch.Tensor, U: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """GCPO's bilateral projection ``(I − U Uᵀ) ΔW (I − V Vᵀ)`` of an update [m, n].

    Provenance: the double-sided projectors are OPLoRA's (related work); applying them to the
    optimizer's final update is RECONSTRUCTED from the GCPO abstract."""
    m, n = update.shape
    left = torch.eye(m, dtype=torch.float64) - U.double() @ U.double().T
    right = torch.eye(n, dtype=torch.float64) - V.double() @ V.double().T
    return left @ update.double() @ right


def principal_overlap(update: torch.Tensor, U: torch.Tensor, V: torch.Tensor) -> tuple[float, float]:
    """(rho_k, PSO) of an update [m, n]: rho_k = |U_kᵀ ΔW V_k|²_F / |ΔW|²_F, and the
    dimension-corrected principal-subspace overlap PSO = rho_k · m n / k² (mean 1 for an isotropic
    random update; 0 for a zero update).

    Provenance: RECONSTRUCTED; the GCPO abstract names the overlap and a dimension correction."""
    m, n = update.shape
    k = U.shape[1]
    total = float(update.double().pow(2).sum())
    if k == 0 or total == 0:
        return 0.0, 0.0
    rho = float((U.double().T @ update.double() @ V.double()).pow(2).sum()) / total
    return rho, rho * m * n / k**2


# ------------------------------------------------------------------------------------ Agon
def agon_step(
    c_draft: torch.Tensor, c_read: torch.Tensor, group_ids: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Agon (RECONSTRUCTED from the abstract): per draft j of prompt group g, the drafter's reward
    ``r_D = c(d) + γ(c(d) − c(a))`` and the reader's ``r_S = c(a) + γ(c(a) − c(d))``, then each
    model's GRPO advantage over its own outputs of the group. Returns (r_D, r_S, A_D, A_S), [G]."""
    from reference.advantages import grpo

    r_d = torch.empty(len(c_draft), dtype=torch.float64)
    r_s = torch.empty(len(c_draft), dtype=torch.float64)
    for j in range(len(c_draft)):
        cd, ca = float(c_draft[j]), float(c_read[j])
        r_d[j] = cd + gamma * (cd - ca)
        r_s[j] = ca + gamma * (ca - cd)
    return r_d, r_s, grpo(r_d, group_ids), grpo(r_s, group_ids)
