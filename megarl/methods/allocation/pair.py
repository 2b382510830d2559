"""PAIR: pairwise-aware inclusion reweighting (formulas: reference/allocation.py; the design and the
predictor are reconstructed, the U-statistic identity is exact algebra).

A prefix allocator (``PrefixAllocator``, megarl/plugin/allocation.py): each prompt gets ``n``
prefixes of ``prefix_tokens`` tokens. A small predictor gives each prefix a success chance p_i
(logistic on the prefix's mean token logprob and the prompt's Beta posterior mean from its decayed
history) and a remaining cost c_i (0 for a prefix that already ended; else the running mean of
continuation lengths, capped by what is left). Inclusion probabilities pi_i in [pi_min, 1] minimise
sum_{i<j} v_ij / (pi_i pi_j), v_ij = p_i (1 - p_j) + p_j (1 - p_i), subject to sum_i pi_i c_i <= B,
B = budget_frac * sum_i c_i (convex in log pi; cyclic coordinate descent inside a bisection on the
budget's multiplier). Independent draws I_i ~ Bern(pi_i) (seeded by the run seed, step and
prompt) pick the samples that are continued and trained on; pi_i and n travel with them.

The advantage estimator ``pair_ht`` turns the Horvitz-Thompson pair estimator into one advantage per
sample (one backward): A_i = (1 / (n - 1)) sum_{j kept, j != i} (R_i - R_j) / (pi_i pi_j), times
N_kept / N_full (N_full: every prompt's n), so that with ``objective.aggregation:
seq-mean-token-sum`` the loss is -(1 / N_full) sum_i A_i log pi(y_i), an unbiased estimate of the
full-group leave-one-out gradient. With every pi_i = 1 it is RLOO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, per_token, scalar_rewards
from megarl.ops.segments import group_all_equal, group_sum
from megarl.plugin.allocation import Continuation, PrefixView
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodParts, MethodSpec
from megarl.registry import PartInfo

PI, SIZE = "pair_pi", "pair_size"  # the batch extras the allocator writes and the estimator reads
P_CLAMP = 1e-4  # predicted success chances are kept inside [P_CLAMP, 1 - P_CLAMP]


def contrast_weights(p: list[float]) -> list[list[float]]:
    """v_ij = p_i (1 - p_j) + p_j (1 - p_i): the chance that the pair (i, j) has a contrast (0 on
    the diagonal)."""
    G = len(p)
    return [[0.0 if i == j else p[i] * (1 - p[j]) + p[j] * (1 - p[i]) for j in range(G)] for i in range(G)]


def design_objective(pi: list[float], v: list[list[float]]) -> float:
    """sum_{i<j} v_ij / (pi_i pi_j)."""
    G = len(pi)
    return sum(v[i][j] / (pi[i] * pi[j]) for i in range(G) for j in range(i + 1, G))


def _coordinate_descent(v, c, lam, pi, pi_min, tol=1e-13, sweeps=2000) -> list[float]:
    """argmin over [pi_min, 1]^G of sum_{i<j} v_ij / (pi_i pi_j) + lam sum_i c_i pi_i, from ``pi``:
    exact minimisation per coordinate (convex in log pi), cyclic, until no coordinate moves."""
    G = len(pi)
    for _ in range(sweeps):
        moved = 0.0
        for i in range(G):
            if c[i] <= 0:
                continue
            a = sum(v[i][j] / pi[j] for j in range(G) if j != i)
            new = min(1.0, max(pi_min, math.sqrt(a / (lam * c[i])))) if a > 0 else pi_min
            moved = max(moved, abs(new - pi[i]))
            pi[i] = new
        if moved <= tol:
            break
    return pi


def inclusion_design(p: list[float], c: list[float], budget: float, pi_min: float) -> list[float]:
    """pi minimising sum_{i<j} v_ij / (pi_i pi_j) over pi in [pi_min, 1] with sum_i pi_i c_i <=
    ``budget`` (``c_i`` = 0: pi_i = 1). Everything fits: all 1; a budget below pi_min sum c: pi_min
    for every costly prefix (the least the design can spend)."""
    v = contrast_weights(p)
    G = len(p)
    if sum(c) <= budget:
        return [1.0] * G
    floor = [1.0 if ci <= 0 else pi_min for ci in c]
    if sum(f * ci for f, ci in zip(floor, c)) >= budget:
        return floor

    def spend(x: list[float]) -> float:
        return sum(xi * ci for xi, ci in zip(x, c))

    lo, hi = -40.0, 40.0  # log of the multiplier; spend falls as it grows
    pi_hi = _coordinate_descent(v, c, math.exp(hi), list(floor), pi_min)
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        x = _coordinate_descent(v, c, math.exp(mid), list(pi_hi), pi_min)
        if spend(x) > budget:
            lo = mid
        else:
            hi, pi_hi = mid, x
        if hi - lo < 1e-12:
            break
    return pi_hi


def pair_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    pi: torch.Tensor,
    size: torch.Tensor,
    full_normaliser: bool = True,
) -> torch.Tensor:
    """A_i = (1 / (n_i - 1)) sum_{j in group, j != i} (R_i - R_j) / (pi_i pi_j) [B], computed as
    w_i (R_i S_w - S_wR) / (n_i - 1) (w = 1 / pi; S: group sums; the j = i terms cancel), 0 for a
    group of equal rewards; with ``full_normaliser`` times N_kept / N_full (N_full = sum over groups
    of their ``size`` n)."""
    w = 1.0 / pi.double()
    r = rewards.double()
    s_w, count = group_sum(w, group_ids)
    s_wr, _ = group_sum(w * r, group_ids)
    adv = w * (r * s_w - s_wr) / (size.double() - 1.0)
    adv = torch.where(group_all_equal(r, group_ids), torch.zeros_like(adv), adv)
    if full_normaliser:
        n_full = float((size.double() / count).sum())  # each group's n, once
        adv = adv * (r.numel() / n_full)
    return adv


def _pair_ht(batch, full_normaliser: bool = True) -> torch.Tensor:
    """PAIR's Horvitz-Thompson advantages on every loss token; [T]."""
    missing = [k for k in (PI, SIZE) if k not in batch.extras]
    if missing:
        raise ValueError(
            f"advantage.estimator=pair_ht needs batch.extras {missing} (the inclusion probabilities "
            "and group sizes a prefix allocator writes): run it with method.name=pair"
        )
    pi, size = batch.extras[PI].double(), batch.extras[SIZE].double()
    if bool((pi <= 0).any()) or bool((pi > 1).any()):
        raise ValueError(
            f"batch.extras[{PI!r}] must be in (0, 1]; got min {float(pi.min())}, max {float(pi.max())}"
        )
    adv = pair_advantages(scalar_rewards(batch), batch.group_ids, pi, size, full_normaliser)
    return per_token(batch, adv)


ADVANTAGE_ESTIMATORS.add("pair_ht", _pair_ht, PartInfo(group_relative=True))


@dataclass
class PAIRKnobs(Knobs):
    """PAIR's prefixes, design, predictor and history (``method`` section)."""

    prefix_tokens: int = 2  # tokens of each prefix (a prefix that ends earlier is a finished sample)
    budget_frac: float = 0.5  # B = budget_frac x the predicted continuation tokens of the prompt
    pi_min: float = 0.1  # smallest inclusion probability of a prefix that needs a continuation
    predictor_lr: float = 0.5  # step of the logistic predictor's gradient steps
    predictor_steps: int = 5  # gradient steps per RL step on the kept samples' outcomes
    history_decay: float = 0.5  # weight of a prompt's older success / failure counts per step seen
    prior_a: float = 1.0  # Beta prior of an unseen prompt's success rate
    prior_b: float = 1.0
    cost_ema: float = 0.7  # EMA weight of the old mean continuation length

    def check(self) -> None:
        """prefix_tokens >= 1; budget_frac in (0, 1]; pi_min in (0, 1]; positive prior and step."""
        if self.prefix_tokens < 1:
            raise ValueError(f"prefix_tokens={self.prefix_tokens} must be >= 1")
        if not (0.0 < self.budget_frac <= 1.0):
            raise ValueError(f"budget_frac={self.budget_frac} must be in (0, 1]")
        if not (0.0 < self.pi_min <= 1.0):
            raise ValueError(f"pi_min={self.pi_min} must be in (0, 1]")
        if self.prior_a <= 0 or self.prior_b <= 0:
            raise ValueError(f"prior_a={self.prior_a}, prior_b={self.prior_b} must be > 0")
        if self.predictor_lr < 0 or self.predictor_steps < 0:
            raise ValueError(
                f"predictor_lr={self.predictor_lr}, predictor_steps={self.predictor_steps} must be >= 0"
            )
        for key in ("history_decay", "cost_ema"):
            if not (0.0 <= getattr(self, key) <= 1.0):
                raise ValueError(f"{key}={getattr(self, key)} must be in [0, 1]")


def _logit(x: float) -> float:
    x = min(max(x, P_CLAMP), 1 - P_CLAMP)
    return math.log(x / (1 - x))


class PAIRAllocator:
    """The prefix allocator (see the module docstring). State: the predictor's weights over
    (1, mean prefix logprob, logit of the prompt's posterior mean), per-prompt history uid ->
    [s, f], the mean continuation length and totals."""

    def __init__(self, knobs: PAIRKnobs, want: int, seed: int):
        self.k, self.want, self.seed = knobs, want, seed
        self.prefix_tokens = knobs.prefix_tokens
        self.weights = [0.0, 0.0, 1.0]  # starts at the prompt's posterior mean
        self.history: dict[int, list[float]] = {}
        self.cont_len: float | None = None
        self.totals = {"prefixes": 0, "kept": 0}

    def features(self, view: PrefixView) -> list[list[float]]:
        """Per prefix (1, mean token logprob, logit of the prompt's posterior mean success rate)."""
        s, f = self.history.get(view.uid, (0.0, 0.0))
        h = _logit((self.k.prior_a + s) / (self.k.prior_a + self.k.prior_b + s + f))
        return [[1.0, sum(lp) / len(lp) if lp else 0.0, h] for lp in view.logprobs]

    def predict(self, view: PrefixView) -> tuple[list[float], list[float]]:
        """(p_i, c_i) per prefix: predicted success chance and remaining tokens."""
        p = []
        for x in self.features(view):
            z = sum(w * xi for w, xi in zip(self.weights, x))
            p.append(min(max(1.0 / (1.0 + math.exp(-z)), P_CLAMP), 1 - P_CLAMP))
        c = []
        for toks, done in zip(view.prefixes, view.finished):
            left = view.max_new_tokens - len(toks)
            c.append(0.0 if done else float(left if self.cont_len is None else min(self.cont_len, left)))
        return p, c

    def uniforms(self, step: int, view: PrefixView) -> list[float]:
        """The prompt's inclusion uniforms, seeded by (run seed, step, row, slot)."""
        seed = (self.seed * 1_000_003 + step * 7_919 + view.uid) * 131 + view.slot
        return torch.rand(view.n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).tolist()

    def choose(self, step: int, view: PrefixView) -> Continuation:
        """The design's pi and seeded Bernoulli draws."""
        p, c = self.predict(view)
        pi = inclusion_design(p, c, self.k.budget_frac * sum(c), self.k.pi_min)
        keep = tuple(ui < x for ui, x in zip(self.uniforms(step, view), pi))
        return Continuation(keep, {PI: tuple(pi), SIZE: tuple(float(view.n) for _ in pi)})

    def end_step(self, step: int, prompts: list) -> dict[str, float]:
        """Fit the predictor on the kept samples' outcomes (reward > 0), fold them into the prompts'
        histories and the mean continuation length; the step's metrics."""
        xs, ys, lens = [], [], []
        d = self.k.history_decay
        history = dict(self.history)
        pis, kept_n, prefixes = [], 0, 0
        for view, dec, rewards, lengths in prompts:
            feats = self.features(view)
            kept = [j for j, k in enumerate(dec.keep) if k]
            prefixes += view.n
            pis += list(dec.extras[PI])
            if not rewards:
                continue
            kept_n += len(kept)
            outs = [1.0 if r > 0 else 0.0 for r in rewards]
            xs += [feats[j] for j in kept]
            ys += outs
            lens += [L - len(view.prefixes[j]) for j, L in zip(kept, lengths) if not view.finished[j]]
            s_h, f_h = history.get(view.uid, (0.0, 0.0))
            history[view.uid] = [d * s_h + sum(outs), d * f_h + len(outs) - sum(outs)]
        self._fit(xs, ys)
        self.history = history
        if lens:
            m = sum(lens) / len(lens)
            self.cont_len = (
                m if self.cont_len is None else self.k.cost_ema * self.cont_len + (1 - self.k.cost_ema) * m
            )
        self.totals = {"prefixes": self.totals["prefixes"] + prefixes, "kept": self.totals["kept"] + kept_n}
        return {
            "pair/pi_mean": sum(pis) / len(pis) if pis else 0.0,
            "pair/kept_frac": kept_n / prefixes if prefixes else 0.0,
            "pair/prompts_known": float(len(self.history)),
            "pair/cont_len": float(self.cont_len or 0.0),
        }

    def _fit(self, xs: list[list[float]], ys: list[float]) -> None:
        """``predictor_steps`` full-batch gradient steps of the logistic loss."""
        if not xs:
            return
        X = torch.tensor(xs, dtype=torch.float64)
        y = torch.tensor(ys, dtype=torch.float64)
        w = torch.tensor(self.weights, dtype=torch.float64)
        for _ in range(self.k.predictor_steps):
            w = w - self.k.predictor_lr * X.T @ (torch.sigmoid(X @ w) - y) / len(ys)
        self.weights = w.tolist()

    def state_dict(self) -> dict:
        """Predictor weights, history, mean continuation length, totals."""
        return {
            "weights": list(self.weights),
            "history": {str(u): list(v) for u, v in self.history.items()},
            "cont_len": self.cont_len,
            "totals": dict(self.totals),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``."""
        self.weights = [float(x) for x in state["weights"]]
        self.history = {int(u): [float(x) for x in v] for u, v in state["history"].items()}
        self.cont_len = None if state["cont_len"] is None else float(state["cont_len"])
        self.totals = {k: int(v) for k, v in state["totals"].items()}


def build(ctx, knobs: PAIRKnobs) -> MethodParts:
    """The run's PAIR allocator (rank 0 uses it)."""
    return MethodParts(
        allocator=PAIRAllocator(knobs, ctx.cfg.schedule.prompts_per_step, ctx.cfg.schedule.seed)
    )


SPEC = MethodSpec(
    name="pair",
    summary="PAIR: continue a convex-design sample of short prefixes, Horvitz-Thompson pair advantages",
    provenance="reconstructed",
    config={"advantage": {"estimator": "pair_ht"}, "objective": {"aggregation": "seq-mean-token-sum"}},
    knobs=PAIRKnobs,
    build=build,
)
