"""Cluster the routed experts of one MoE layer and pick one representative per cluster.

Experts are points ``phi: [E, D]`` (unit rows; see ``expert_features``). Distance is ``1 - cos``,
which on unit rows is half the squared Euclidean distance, so k-means on unit rows minimises the
same thing average linkage looks at. Both algorithms are written here in numpy (no sklearn) and
are deterministic: agglomerative clustering has no randomness at all (ties go to the lowest
indices), k-means draws its k-means++ seeds from ``numpy.random.default_rng(seed)``.

Group-limited routing (DeepSeek-style ``n_group``): experts ``[g*E/G, (g+1)*E/G)`` form routing
group ``g``; ``cluster_layer`` clusters each group on its own into ``E'/G`` clusters, so no
cluster crosses a group and every group keeps the same number of experts.
"""

from __future__ import annotations

import numpy as np

METHODS = ("agglomerative", "kmeans")
REPRESENTATIVES = ("mass", "medoid")


def _unit_rows(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(n > 0, n, 1.0)


def expert_features(out_signature: np.ndarray, router_rows: np.ndarray, kappa: float = 1.0) -> np.ndarray:
    """``phi_e = unit([unit(o_e); kappa * unit(w_e)])``.

    out_signature: [E, H] mean expert output over all calibration tokens; router_rows: [E, H]
    router weight rows. Returns [E, 2H] unit rows (float64).
    """
    phi = np.concatenate(
        [_unit_rows(out_signature.astype(np.float64)), kappa * _unit_rows(router_rows.astype(np.float64))],
        axis=1,
    )
    return _unit_rows(phi)


def cosine_distance(phi: np.ndarray) -> np.ndarray:
    """[E, E] matrix of ``1 - cos`` between the rows of ``phi`` (clipped at 0, exact zero diagonal)."""
    u = _unit_rows(phi)
    d = np.clip(1.0 - u @ u.T, 0.0, 2.0)
    np.fill_diagonal(d, 0.0)
    return d


def agglomerative(dist: np.ndarray, n_clusters: int) -> list[list[int]]:
    """Average-linkage agglomerative clustering of ``dist: [n, n]`` into ``n_clusters`` clusters.

    Merges the closest pair of clusters until ``n_clusters`` remain (Lance-Williams update for
    average linkage). Ties: the pair whose (smaller, larger) cluster labels are lowest. Returns
    clusters as sorted member lists, ordered by their smallest member.
    """
    n = dist.shape[0]
    if not 1 <= n_clusters <= n:
        raise ValueError(f"n_clusters={n_clusters} must be in [1, {n}]")
    d = dist.astype(np.float64).copy()
    np.fill_diagonal(d, np.inf)
    members: dict[int, list[int]] = {i: [i] for i in range(n)}
    active = list(range(n))
    while len(active) > n_clusters:
        sub = d[np.ix_(active, active)]
        flat = int(np.argmin(sub))  # first minimum in row-major order = lowest (i, j)
        i, j = active[flat // len(active)], active[flat % len(active)]
        a, b = min(i, j), max(i, j)
        na, nb = len(members[a]), len(members[b])
        new = (na * d[a] + nb * d[b]) / (na + nb)
        d[a, :] = new
        d[:, a] = new
        d[a, a] = np.inf
        d[b, :] = np.inf
        d[:, b] = np.inf
        members[a] = sorted(members[a] + members.pop(b))
        active.remove(b)
    return sorted((members[i] for i in active), key=lambda m: m[0])


def kmeans(
    phi: np.ndarray, n_clusters: int, seed: int, n_init: int = 4, max_iter: int = 100
) -> list[list[int]]:
    """k-means++ / Lloyd on the rows of ``phi: [n, D]``, best of ``n_init`` seeded restarts.

    Every cluster is non-empty (an emptied cluster takes the point farthest from its centre).
    Deterministic for a given ``seed``. Returns clusters as sorted member lists, ordered by their
    smallest member.
    """
    n = phi.shape[0]
    if not 1 <= n_clusters <= n:
        raise ValueError(f"n_clusters={n_clusters} must be in [1, {n}]")
    x = phi.astype(np.float64)
    rng = np.random.default_rng(seed)
    best: tuple[float, np.ndarray] | None = None
    for _ in range(n_init):
        centres = [x[int(rng.integers(n))]]
        for _ in range(1, n_clusters):
            d2 = np.min(((x[:, None, :] - np.asarray(centres)[None]) ** 2).sum(-1), axis=1)
            total = d2.sum()
            idx = int(rng.choice(n, p=d2 / total)) if total > 0 else int(rng.integers(n))
            centres.append(x[idx])
        c = np.asarray(centres)
        labels = np.full(n, -1)
        for _ in range(max_iter):
            d2 = ((x[:, None, :] - c[None]) ** 2).sum(-1)
            new = np.argmin(d2, axis=1)
            for k in range(n_clusters):  # refill empty clusters deterministically
                if not np.any(new == k):
                    far = int(np.argmax(d2[np.arange(n), new]))
                    new[far] = k
            if np.array_equal(new, labels):
                break
            labels = new
            c = np.stack([x[labels == k].mean(0) for k in range(n_clusters)])
        inertia = float(((x - c[labels]) ** 2).sum())
        if best is None or inertia < best[0] - 1e-12:
            best = (inertia, labels.copy())
    labels = best[1]
    return sorted(
        ([int(i) for i in np.flatnonzero(labels == k)] for k in range(n_clusters)), key=lambda m: m[0]
    )


def choose_representative(
    members: list[int], mass: np.ndarray, saliency: np.ndarray, dist: np.ndarray, rule: str = "mass"
) -> int:
    """The expert of a cluster that is kept.

    ``mass``: highest routing mass (sum of gate weights on calibration tokens), ties broken by
    activation-norm saliency, then by lowest index. ``medoid``: smallest summed distance to the
    other members, ties by mass then lowest index. mass, saliency: [E]; dist: [E, E].
    """
    if rule == "mass":
        return min(members, key=lambda e: (-mass[e], -saliency[e], e))
    if rule == "medoid":
        return min(members, key=lambda e: (float(dist[e, members].sum()), -mass[e], e))
    raise ValueError(f"representative rule {rule!r}; allowed: {', '.join(REPRESENTATIVES)}")


def cluster_layer(
    phi: np.ndarray,
    n_keep: int,
    *,
    method: str,
    seed: int,
    n_group: int = 1,
    mass: np.ndarray,
    saliency: np.ndarray,
    representative: str = "mass",
) -> tuple[list[list[int]], list[int]]:
    """Cluster the E experts of one layer into ``n_keep`` clusters and choose the kept experts.

    phi: [E, D] features; mass, saliency: [E]. With ``n_group`` > 1 each routing group of E/G
    consecutive experts is clustered alone into n_keep/G clusters. Returns ``(clusters, kept)``:
    clusters as global expert ids (sorted lists, ordered by smallest member), and ``kept[c]`` the
    representative of ``clusters[c]``.
    """
    if method not in METHODS:
        raise ValueError(f"clustering method {method!r}; allowed: {', '.join(METHODS)}")
    E = phi.shape[0]
    if E % n_group or n_keep % n_group:
        raise ValueError(f"E={E} and E'={n_keep} must both be divisible by n_group={n_group}")
    dist = cosine_distance(phi)
    per_in, per_out = E // n_group, n_keep // n_group
    clusters: list[list[int]] = []
    for g in range(n_group):
        ids = np.arange(g * per_in, (g + 1) * per_in)
        if method == "agglomerative":
            local = agglomerative(dist[np.ix_(ids, ids)], per_out)
        else:
            local = kmeans(phi[ids], per_out, seed=seed + g)
        clusters += [[int(ids[i]) for i in m] for m in local]
    kept = [choose_representative(m, mass, saliency, dist, representative) for m in clusters]
    return clusters, kept
