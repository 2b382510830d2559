"""Rollout allocation (method family 6): the allocators' decisions as plain functions.

Every function takes counts and knobs and returns a number or a decision; ``simulate_step`` replays
one step of streaming allocation (megarl/trainer/streaming.py) sequentially over known outcomes.
Decisions: a target number of samples for a prompt (``n`` commits its group) or ``ABANDON``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

ABANDON = -1


# ------------------------------------------------------------------------------------ SARA
def sara_prior(
    hist_s: float, hist_f: float, prior_a: float = 1.0, prior_b: float = 1.0
) -> tuple[float, float]:
    """SARA's prior Beta(a0, b0) of a prompt: the base prior plus its (decayed) past successes and
    failures. Provenance: RECONSTRUCTED (the abstract says "prior from history, or Beta(1,1)")."""
    return prior_a + hist_s, prior_b + hist_f


def sara_pooled_prior(mu: float, strength: float, clamp: float = 0.02) -> tuple[float, float]:
    """SARA's empirical-Bayes base prior Beta(k mu, k (1 - mu)) from the running success rate ``mu``
    (kept in [clamp, 1 - clamp]) of all samples. Provenance: RECONSTRUCTED (our choice of base prior
    for prompts without history; not in the abstract)."""
    mu = min(max(mu, clamp), 1.0 - clamp)
    return strength * mu, strength * (1.0 - mu)


def sara_running_rate(mu: float | None, rate: float, decay: float) -> float:
    """The running success rate after a step whose samples succeeded at ``rate``. RECONSTRUCTED."""
    return rate if mu is None else decay * mu + (1.0 - decay) * rate


def sara_history(hist_s: float, hist_f: float, s: int, f: int, decay: float) -> tuple[float, float]:
    """A prompt's history after a step that saw ``s`` successes and ``f`` failures: old counts are
    multiplied by ``decay`` (0: only the latest step counts; 1: all steps count alike). RECONSTRUCTED."""
    return decay * hist_s + s, decay * hist_f + f


def sara_effectiveness(s: int, f: int, a0: float, b0: float, n: int) -> float:
    """P(the group of ``n`` ends with mixed outcomes | s successes, f failures so far), under the
    posterior Beta(a0 + s, b0 + f):

        1 if s > 0 and f > 0;
        1 - E[p^m]      = 1 - prod_{j<m} (a + j) / (a + b + j)   if f == 0 (m = n - s - f);
        1 - E[(1-p)^m]  = 1 - prod_{j<m} (b + j) / (a + b + j)   if s == 0.

    With s == f == 0 the group is mixed unless all n agree: 1 - E[p^n] - E[(1-p)^n].
    Provenance: RECONSTRUCTED (Beta moments; the abstract names a closed-form predictor).
    """
    if s > 0 and f > 0:
        return 1.0
    a, b, m = a0 + s, b0 + f, n - s - f
    all_s = all_f = 1.0
    for j in range(m):
        all_s *= (a + j) / (a + b + j)
        all_f *= (b + j) / (a + b + j)
    if s == 0 and f == 0:
        return 1.0 - all_s - all_f
    return 1.0 - (all_s if f == 0 else all_f)


def sara_decide(
    outcomes: Sequence[float],
    n: int,
    a0: float,
    b0: float,
    probe: int = 2,
    tau_lo: float = 0.2,
    tau_hi: float = 0.8,
    rewards: Sequence[float] = (),
) -> int:
    """SARA's two-threshold rule on a prompt's landed outcomes (1 success, 0 failure).

    Mixed outcomes, or scalar ``rewards`` that already differ (a shaped reward): commit (``n``), also
    before the probe ends. Fewer than ``probe`` landed: sample
    up to the probe. Else with
    P_eff = ``sara_effectiveness``: abandon if P_eff <= tau_lo, commit if P_eff >= tau_hi, otherwise
    one more sample. Provenance: RECONSTRUCTED (SPRT-style two thresholds, from the abstract).
    """
    k = len(outcomes)
    s = int(sum(1 for o in outcomes if o > 0.5))
    f = k - s
    if (s > 0 and f > 0) or len(set(rewards)) > 1:
        return n
    if k < probe:
        return min(probe, n)
    p_eff = sara_effectiveness(s, f, a0, b0, n)
    if p_eff <= tau_lo:
        return ABANDON
    if p_eff >= tau_hi:
        return n
    return k + 1


# ------------------------------------------------------------------------------------ the scheduler
def simulate_step(
    decide: Callable[[int, list[float]], int],
    outcomes: Callable[[int, int], float],
    n: int,
    want: int,
    budget: int,
    request_size: int = 0,
) -> list[tuple[str, int, list[float]]]:
    """One step of streaming allocation, sequentially, over known outcomes.

    ``decide(slot, landed_outcomes)`` -> target or ``ABANDON``; ``outcomes(slot, j)``: the j-th
    sample's outcome of slot ``slot``. A decision's new samples go out as requests of
    ``request_size`` samples (0: one request); ``decide`` runs after each request lands, in issue
    order, until the slot has ``n`` outcomes (committed) or is abandoned (its samples in flight
    are charged). A slot is opened while fewer than ``want`` slots are committed or open and ``n``
    more samples fit in ``budget`` next to the open slots' ``n`` and the closed slots' spend
    (committed: ``n``; abandoned: the samples issued). Returns per opened slot (state, samples
    issued, outcomes seen), in slot order: what the concurrent scheduler ends with whatever order
    samples land in, because a slot's decisions depend only on its own outcomes and both the
    reservations and the count of live slots only shrink as slots close.
    """
    out: list[tuple[str, int, list[float]]] = []
    committed = spent = 0
    while committed < want and spent + n <= budget:
        slot = len(out)
        seen: list[float] = []
        requests: list[int] = []
        landed = issued = 0
        target = decide(slot, [])
        while True:
            if target == ABANDON:
                state = "abandoned"
                break
            if not (len(seen) < target <= n):
                raise ValueError(f"target {target} with {len(seen)} of {n} landed")
            while issued < target:
                size = min(request_size or target - issued, target - issued)
                requests.append(size)
                issued += size
            seen += [outcomes(slot, j) for j in range(len(seen), len(seen) + requests[landed])]
            landed += 1
            if len(seen) >= n:
                state = "committed"
                break
            target = decide(slot, list(seen))
        out.append((state, issued, seen))
        committed += state == "committed"
        spent += n if state == "committed" else issued
    return out


def effective(outcomes: Sequence[float]) -> bool:
    """A group with a non-zero GRPO gradient: its outcomes differ."""
    return len(set(outcomes)) > 1


# ------------------------------------------------------------------------------------ PAC
# Provenance of every PAC function: RECONSTRUCTED (no source found; anchored on DUMP's expected
# |advantage| per task and BOTS's Thompson sampling over tasks).
def pac_task_stats(rewards_per_group: Sequence[Sequence[float]], eps: float = 1e-6) -> tuple[float, float]:
    """(mean |A| over the task's samples, mean reward) of one task's groups this step; A is the
    GRPO advantage (R - mean) / (unbiased std + eps) inside each group, 0 for a group of equal
    rewards."""
    abs_adv, total, count = 0.0, 0.0, 0
    for g in rewards_per_group:
        m = sum(g) / len(g)
        var = sum((r - m) ** 2 for r in g) / max(len(g) - 1, 1)
        equal = all(r == g[0] for r in g)
        for r in g:
            abs_adv += 0.0 if equal else abs((r - m) / (var**0.5 + eps))
            total += r
            count += 1
    return abs_adv / count, total / count


def pac_zscores(values: Sequence[float]) -> list[float]:
    """Standardisation across tasks: (v - mean) / std (population std); all 0 when std is 0."""
    m = sum(values) / len(values)
    sd = (sum((v - m) ** 2 for v in values) / len(values)) ** 0.5
    return [0.0 if sd == 0 else (v - m) / sd for v in values]


def pac_update(
    state: dict,
    observed: dict[str, tuple[float, float]],
    beta: float = 1.0,
    ema: float = 0.7,
    discount: float = 0.9,
    clip_progress: bool = False,
) -> dict:
    """One step of PAC's per-task statistics, a new state (the input is not changed).

    ``state``: task -> {"L", "P", "last", "n", "s"} (learnability EMA, progress EMA, the last mean
    reward, the discounted count and sum of utilities); ``observed``: task -> (mean |A|, mean reward)
    this step. For an observed task: L <- ema L + (1 - ema) mean|A| (the first observation sets it),
    P <- ema P + (1 - ema) (r - last) (0 until a second observation; clipped at 0 with
    ``clip_progress``). Utilities u_k = z(L)_k + beta z(P)_k across all tasks with statistics; every
    task's sufficient statistics are discounted (n, s <- discount n, discount s) and the observed
    ones add (1, u_k).
    """
    new = {k: dict(v) for k, v in state.items()}
    for task, (abs_adv, reward) in observed.items():
        st = new.setdefault(task, {"L": None, "P": 0.0, "last": None, "n": 0.0, "s": 0.0})
        st["L"] = abs_adv if st["L"] is None else ema * st["L"] + (1 - ema) * abs_adv
        if st["last"] is not None:
            gain = reward - st["last"]
            st["P"] = ema * st["P"] + (1 - ema) * gain
            if clip_progress:
                st["P"] = max(st["P"], 0.0)
        st["last"] = reward
    tasks = sorted(t for t in new if new[t]["L"] is not None)
    zl = dict(zip(tasks, pac_zscores([new[t]["L"] for t in tasks]))) if tasks else {}
    zp = dict(zip(tasks, pac_zscores([new[t]["P"] for t in tasks]))) if tasks else {}
    for t, st in new.items():
        st["n"], st["s"] = discount * st["n"], discount * st["s"]
        if t in observed:
            st["n"] += 1.0
            st["s"] += zl[t] + beta * zp[t]
    return new


def pac_posterior(st: dict, sigma: float = 1.0, n0: float = 1.0) -> tuple[float, float]:
    """(mean, std) of a task's utility posterior N(s / (n + n0), sigma^2 / (n + n0))."""
    return st["s"] / (st["n"] + n0), sigma / (st["n"] + n0) ** 0.5


def pac_probs(theta: Sequence[float], temperature: float = 1.0, epsilon: float = 0.1) -> list[float]:
    """p_k = (1 - epsilon) softmax(theta / temperature)_k + epsilon / K."""
    m = max(theta)
    e = [math.exp((t - m) / temperature) for t in theta]
    z = sum(e)
    return [(1 - epsilon) * x / z + epsilon / len(theta) for x in e]


def largest_remainder(probs: Sequence[float], total: int) -> list[int]:
    """Integer counts summing to ``total``: floor(p_k total), the remainder to the largest fractional
    parts (ties: the lower index first)."""
    raw = [p * total for p in probs]
    counts = [int(x) for x in raw]
    order = sorted(range(len(raw)), key=lambda k: (-(raw[k] - counts[k]), k))
    for k in order[: total - sum(counts)]:
        counts[k] += 1
    return counts


# ------------------------------------------------------------------------------------ PAIR
# Provenance: the U-statistic identity is exact algebra; the inclusion design (variance proxy, budget,
# independent inclusion) and the Horvitz-Thompson weights are RECONSTRUCTED from the PAIR abstract.
def pair_loo_gradient(R: Sequence[float], s: Sequence) -> object:
    """The unclipped leave-one-out score gradient of one prompt:
    (1/G) sum_i (R_i - (1/(G-1)) sum_{j != i} R_j) s_i (``s``: one score vector per sample)."""
    G = len(R)
    return sum((R[i] - sum(R[j] for j in range(G) if j != i) / (G - 1)) * s[i] for i in range(G)) / G


def pair_u_statistic(R: Sequence[float], s: Sequence) -> object:
    """The same gradient as a U-statistic over pairs: (1/(G(G-1))) sum_{i<j} (R_i - R_j)(s_i - s_j)."""
    G = len(R)
    pairs = [(R[i] - R[j]) * (s[i] - s[j]) for i in range(G) for j in range(i + 1, G)]
    return sum(pairs) / (G * (G - 1))


def pair_ht_gradient(R: Sequence[float], s: Sequence, incl: Sequence[int], pi: Sequence[float]) -> object:
    """Horvitz-Thompson: (1/(G(G-1))) sum_{i<j} I_i I_j (R_i - R_j)(s_i - s_j) / (pi_i pi_j)
    (independent inclusion: pi_ij = pi_i pi_j)."""
    G = len(R)
    total = 0.0 * s[0]
    for i in range(G):
        for j in range(i + 1, G):
            if incl[i] and incl[j]:
                total = total + (R[i] - R[j]) * (s[i] - s[j]) / (pi[i] * pi[j])
    return total / (G * (G - 1))


def pair_ht_advantages(R: Sequence[float], incl: Sequence[int], pi: Sequence[float]) -> list[float]:
    """The HT estimator collapsed to one advantage per sample (one backward):
    A_i = I_i / (G(G-1)) sum_{j != i} I_j (R_i - R_j) / (pi_i pi_j); sum_i A_i s_i is
    ``pair_ht_gradient``."""
    G = len(R)
    return [
        incl[i] * sum(incl[j] * (R[i] - R[j]) / (pi[i] * pi[j]) for j in range(G) if j != i) / (G * (G - 1))
        for i in range(G)
    ]


def pair_design_objective(pi: Sequence[float], p: Sequence[float]) -> float:
    """The variance proxy sum_{i<j} v_ij / (pi_i pi_j), v_ij = p_i (1 - p_j) + p_j (1 - p_i)."""
    G = len(pi)
    return sum(
        (p[i] * (1 - p[j]) + p[j] * (1 - p[i])) / (pi[i] * pi[j]) for i in range(G) for j in range(i + 1, G)
    )


def _project(y: Sequence[float], c: Sequence[float], budget: float, pi_min: float) -> list[float]:
    """Euclidean projection onto {pi in [pi_min, 1]^G (pi_i = 1 where c_i = 0), sum c pi <= budget}:
    clip(y - t c) with the smallest t >= 0 that meets the budget (bisection)."""

    def at(t: float) -> list[float]:
        return [1.0 if ci <= 0 else min(1.0, max(pi_min, yi - t * ci)) for yi, ci in zip(y, c)]

    if sum(x * ci for x, ci in zip(at(0.0), c)) <= budget:
        return at(0.0)
    lo, hi = 0.0, 1.0
    while sum(x * ci for x, ci in zip(at(hi), c)) > budget:
        hi *= 2
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if sum(x * ci for x, ci in zip(at(mid), c)) > budget:
            lo = mid
        else:
            hi = mid
    return at(hi)


def pair_design(
    p: Sequence[float], c: Sequence[float], budget: float, pi_min: float, iters: int = 20000
) -> list[float]:
    """PAIR's inclusion design: pi minimising ``pair_design_objective`` over pi in [pi_min, 1] with
    sum_i pi_i c_i <= budget (c_i = 0: pi_i = 1), by projected gradient descent with backtracking
    (the objective is convex in pi). A budget below pi_min sum c gives pi_min on every costly prefix."""
    G = len(p)
    if sum(c) <= budget:
        return [1.0] * G
    if sum(pi_min * ci for ci in c) >= budget:
        return [1.0 if ci <= 0 else pi_min for ci in c]
    pi = _project([1.0] * G, c, budget, pi_min)
    f = pair_design_objective(pi, p)
    step = 1e-2
    for _ in range(iters):
        grad = [
            -sum((p[i] * (1 - p[j]) + p[j] * (1 - p[i])) / (pi[i] ** 2 * pi[j]) for j in range(G) if j != i)
            for i in range(G)
        ]
        while True:
            new = _project([x - step * g for x, g in zip(pi, grad)], c, budget, pi_min)
            fn = pair_design_objective(new, p)
            if fn <= f - 1e-4 * sum((a - b) ** 2 for a, b in zip(pi, new)) / step or step < 1e-14:
                break
            step *= 0.5
        if max(abs(a - b) for a, b in zip(pi, new)) < 1e-12:
            pi = new
            break
        pi, f, step = new, fn, step * 2
    return pi


def pair_draw(pi: Sequence[float], u: Sequence[float]) -> list[bool]:
    """Independent (Poisson) inclusion: I_i = [u_i < pi_i] for uniforms ``u``."""
    return [ui < x for ui, x in zip(u, pi)]


# ------------------------------------------------------------------------------------ LLMZero
# Tree search over training-strategy transitions (paper: MCTS over (checkpoint, config) nodes; the
# bookkeeping below is ours). A node is a dict: id, parent, depth, config (the run's overrides,
# cumulative from the root), children (ids), pending (proposed configs not yet trained), visits,
# value_sum, value (its own stage's validation metric), done (nothing left to expand under it).
def llmzero_uct(value_sum: float, visits: int, parent_visits: int, c: float) -> float:
    """UCT ``Q + c sqrt(ln N_parent / N)``; +inf for an unvisited node."""
    if visits == 0:
        return math.inf
    return value_sum / visits + c * math.sqrt(math.log(max(parent_visits, 1)) / visits)


def llmzero_select(nodes: list[dict], c: float, k: int, max_depth: int) -> dict | None:
    """From the root, descend by UCT (ties: the lowest id; done children skipped) to the first node
    that can take another child (depth < max_depth, fewer than ``k`` children); None when the whole
    tree is done."""
    node = nodes[0]
    while True:
        if node["done"]:
            return None
        if node["depth"] < max_depth and len(node["children"]) < k:
            return node
        live = [nodes[i] for i in node["children"] if not nodes[i]["done"]]
        scores = [llmzero_uct(ch["value_sum"], ch["visits"], node["visits"], c) for ch in live]
        node = live[scores.index(max(scores))]


def llmzero_backup(nodes: list[dict], leaf: int, value: float, k: int, max_depth: int) -> None:
    """Add ``value`` to every node from ``leaf`` up to the root; mark done what has nothing left
    (a leaf at max_depth; a node with k children, all done)."""
    i: int | None = leaf
    while i is not None:
        n = nodes[i]
        n["visits"] += 1
        n["value_sum"] += value
        full = n["depth"] >= max_depth or len(n["children"]) >= k
        n["done"] = full and all(nodes[j]["done"] for j in n["children"])
        i = n["parent"]


def llmzero_capacity(parent: dict, child: dict, capacity: Sequence[str]) -> dict:
    """The capacity prior: each capacity key of ``child`` at least its value in ``parent``."""
    out = dict(child)
    for key in capacity:
        if key in parent and key in out and out[key] < parent[key]:
            out[key] = parent[key]
    return out


def llmzero_search(
    propose: Callable[[dict, int], list[dict]],
    simulate: Callable[[dict], float],
    cost: Callable[[dict], float],
    budget: float,
    k: int,
    c: float,
    max_depth: int,
    capacity: Sequence[str] = (),
) -> tuple[list[dict], float]:
    """The search: train the root, then repeat select -> (propose ``k`` configs when a node has none
    pending) -> train the next pending one as a new child -> back its value up, while the next stage
    fits the budget. ``propose(node, m)`` -> m configs (overrides), ``simulate(node)`` -> value,
    ``cost(config)`` -> compute of one stage. Returns (nodes, compute spent <= budget)."""
    root = {"id": 0, "parent": None, "depth": 0, "config": {}, "children": [], "pending": []}
    root.update(visits=0, value_sum=0.0, value=None, done=False)
    nodes, spent = [root], 0.0
    if cost(root["config"]) > budget:
        return nodes, spent
    spent += cost(root["config"])
    root["value"] = simulate(root)
    llmzero_backup(nodes, 0, root["value"], k, max_depth)
    while True:
        node = llmzero_select(nodes, c, k, max_depth)
        if node is None:
            break
        if not node["pending"]:
            node["pending"] = list(propose(node, k - len(node["children"])))
        cfg = llmzero_capacity(node["config"], {**node["config"], **node["pending"][0]}, capacity)
        if spent + cost(cfg) > budget:
            break
        node["pending"].pop(0)
        child = {"id": len(nodes), "parent": node["id"], "depth": node["depth"] + 1, "config": cfg}
        child.update(children=[], pending=[], visits=0, value_sum=0.0, value=None, done=False)
        nodes.append(child)
        node["children"].append(child["id"])
        spent += cost(cfg)
        child["value"] = simulate(child)
        llmzero_backup(nodes, child["id"], child["value"], k, max_depth)
    return nodes, spent


def llmzero_random_configs(space: dict, count: int, seed: int, node_id: int) -> list[dict]:
    """Random search's draws: ``count`` configs, each key's value uniform over ``space[key]``, from
    ``random.Random(seed * 1_000_003 + node_id)``."""
    import random

    rng = random.Random(seed * 1_000_003 + node_id)
    return [{key: rng.choice(list(vals)) for key, vals in sorted(space.items())} for _ in range(count)]


# ------------------------------------------------------------------------------------ TrajVal
# Provenance of every TrajVal function: RECONSTRUCTED (no source found; the spec's formulas).
def trajval_learnability(
    acc0: float, acc1: float, n_eval: float, headroom: bool = True, eps: float = 1e-3, n0: float = 0.0
) -> float:
    """l_k = max(0, acc1 - acc0) / (1 - acc0 + eps) (headroom-normalised; else max(0, acc1 - acc0)),
    shrunk by n_eval / (n_eval + n0)."""
    gain = acc1 - acc0
    ell = (gain if gain > 0 else 0.0) / ((1.0 - acc0 + eps) if headroom else 1.0)
    return ell * (n_eval / (n_eval + n0))


def trajval_prior(ell: Sequence[float], beta: float = 1.0, eps0: float = 0.01) -> list[float]:
    """pi_k = (l_k + eps0)^beta / sum_j (l_j + eps0)^beta."""
    w = [math.exp(beta * math.log(x + eps0)) for x in ell]
    return [x / sum(w) for x in w]


def trajval_combine(scores: Sequence[float], pi: Sequence[float]) -> list[float]:
    """The multiplicative prior on an online scheduler: p_k = s_k pi_k / sum_j s_j pi_j."""
    w = [s * p for s, p in zip(scores, pi)]
    return [x / sum(w) for x in w]


# ------------------------------------------------------------------------------------ MASS
# Provenance of every MASS function: RECONSTRUCTED (no source found; the spec's selection rules).
def mass_topk(pre: Sequence[Sequence[float]], K: int) -> list[list[float]]:
    """TopK codes: per row the K largest pre-activations kept (ties: the lower index), the rest 0."""
    out = []
    for row in pre:
        keep = sorted(range(len(row)), key=lambda j: (-row[j], j))[:K]
        out.append([row[j] if j in keep else 0.0 for j in range(len(row))])
    return out


def mass_split_budget(sizes: Sequence[int], budget: int, mode: str = "size") -> list[int]:
    """Group budgets B_g proportional to |g| (or sqrt |g|), largest remainder, capped at |g|; a
    capped group's excess is split again over the others."""
    out = [0] * len(sizes)
    left = budget
    while left > 0:
        open_ = [g for g in range(len(sizes)) if out[g] < sizes[g]]
        w = {g: (sizes[g] ** 0.5 if mode == "sqrt" else sizes[g]) for g in open_}
        raw = {g: left * w[g] / sum(w.values()) for g in open_}
        add = {g: math.floor(raw[g]) for g in open_}
        for g in sorted(open_, key=lambda g: (add[g] - raw[g], g))[: left - sum(add.values())]:
            add[g] += 1
        for g in open_:
            take = min(add[g], sizes[g] - out[g])
            out[g] += take
            left -= take
    return out


def mass_greedy(
    q: Sequence[float], codes: Sequence[Sequence[float]], budget: int, weight: str = "idf"
) -> tuple[list[int], list[float]]:
    """Quality-aware greedy coverage in one group: pick argmax_x q(x) sum_{f in F(x) uncovered} u_f
    (u_f = log((1 + N) / (1 + df_f)) or |h_f(x)|), ties to the lower index; when no sample adds
    coverage, the rest by quality (ties: lower index). Returns (picks, marginal gains)."""
    N, F = len(codes), len(codes[0])
    df = [sum(1 for x in range(N) if codes[x][f] != 0) for f in range(F)]
    covered: set[int] = set()
    picks: list[int] = []
    gains: list[float] = []
    while len(picks) < budget:
        best, arg = 0.0, -1
        for x in range(N):
            if x in picks:
                continue
            u = [
                (math.log((1 + N) / (1 + df[f])) if weight == "idf" else abs(codes[x][f]))
                for f in range(F)
                if codes[x][f] != 0 and f not in covered
            ]
            g = q[x] * sum(u)
            if g > 0 and g > best * (1 + 1e-12):
                best, arg = g, x
        if arg < 0:
            rest = sorted((x for x in range(N) if x not in picks), key=lambda x: (-q[x], x))
            picks += rest[: budget - len(picks)]
            gains += [0.0] * (budget - len(gains))
            break
        picks.append(arg)
        gains.append(best)
        covered |= {f for f in range(F) if codes[arg][f] != 0}
    return picks, gains
