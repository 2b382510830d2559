"""SARA: sequential adaptive rollout allocation (formulas: reference/allocation.py, reconstructed).

A streaming allocator (megarl/plugin/allocation.py): each prompt's success rate has a Beta
posterior, prior Beta(prior_a + s_h, prior_b + f_h) from the prompt's decayed history of successes
``s_h`` and failures ``f_h`` (with ``pooled_strength`` k > 0 the base prior is Beta(k mu,
k (1 - mu)), mu the running success rate of all samples: an empirical-Bayes prior for prompts seen
rarely). A prompt whose outcomes are mixed, or whose scalar rewards already differ (shaped
rewards), is committed at once (its group of ``n`` will have a non-zero GRPO gradient); otherwise,
after a probe of ``probe`` samples, the closed-form probability that the full group ends mixed,
P_eff = 1 - E[p^m] (all successes so far) or 1 - E[(1-p)^m] (all failures), decides: abandon at
P_eff <= tau_lo, commit at P_eff >= tau_hi, else one more sample. Abandoned prompts give their
unspent samples back to the step's budget and the scheduler opens fresh prompts with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.plugin.allocation import ABANDON, PromptView, StepBudget
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodParts, MethodSpec

MU_CLAMP = 0.02  # the pooled prior's success rate is kept inside [MU_CLAMP, 1 - MU_CLAMP]


def beta_all_same(a: float, b: float, m: int) -> tuple[float, float]:
    """(E[p^m], E[(1-p)^m]) under Beta(a, b), in log space: prod_{j<m} (a+j)/(a+b+j) and the same
    with b."""
    js = range(m)
    ls = sum(math.log(a + j) - math.log(a + b + j) for j in js)
    lf = sum(math.log(b + j) - math.log(a + b + j) for j in js)
    return math.exp(ls), math.exp(lf)


def effectiveness(s: int, f: int, a0: float, b0: float, n: int) -> float:
    """P(a group of ``n`` ends with mixed outcomes | s successes and f failures so far, prior
    Beta(a0, b0))."""
    if s > 0 and f > 0:
        return 1.0
    all_s, all_f = beta_all_same(a0 + s, b0 + f, n - s - f)
    if s == 0 and f == 0:
        return 1.0 - all_s - all_f
    return 1.0 - (all_s if f == 0 else all_f)


@dataclass
class SARAKnobs(Knobs):
    """SARA's thresholds, probe, prior, history and budget (``method`` section)."""

    probe: int = 2  # samples before the first commit/abandon decision (mixed outcomes commit earlier)
    tau_lo: float = 0.2  # abandon when P_eff <= tau_lo (0: never abandon)
    tau_hi: float = 0.8  # commit when P_eff >= tau_hi
    prior_a: float = 1.0  # base prior Beta(prior_a, prior_b) of an unseen prompt
    prior_b: float = 1.0
    history_decay: float = 0.5  # weight of a prompt's older counts per step it is seen (0: no memory)
    pooled_strength: float = 0.0  # > 0: base prior Beta(k*mu, k*(1-mu)), mu the running success rate
    budget_samples: int = 0  # samples per step (0: prompts_per_step x rollout.n, the fixed allocation's)
    budget_tokens: int = 0  # generated tokens per step (0: no token budget)
    request_size: int = 0  # samples per engine request (0: one request per decision)

    def check(self) -> None:
        """Probe >= 1; 0 <= tau_lo <= tau_hi <= 1; positive prior; decay in [0, 1]; budgets >= 0."""
        if self.probe < 1:
            raise ValueError(f"probe={self.probe} must be >= 1")
        if not (0.0 <= self.tau_lo <= self.tau_hi <= 1.0):
            raise ValueError(f"tau_lo={self.tau_lo}, tau_hi={self.tau_hi}: need 0 <= tau_lo <= tau_hi <= 1")
        if self.prior_a <= 0 or self.prior_b <= 0:
            raise ValueError(f"prior_a={self.prior_a}, prior_b={self.prior_b} must be > 0")
        if self.pooled_strength < 0:
            raise ValueError(f"pooled_strength={self.pooled_strength} must be >= 0")
        if not (0.0 <= self.history_decay <= 1.0):
            raise ValueError(f"history_decay={self.history_decay} must be in [0, 1]")
        for key in ("budget_samples", "budget_tokens", "request_size"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 0")


class SARAAllocator:
    """The streaming allocator (see the module docstring); ``history``: uid -> [s_h, f_h]."""

    def __init__(self, knobs: SARAKnobs, want: int):
        self.k, self.want = knobs, want
        self.request_size = knobs.request_size
        self.history: dict[int, list[float]] = {}
        self.totals = {"abandoned": 0, "committed": 0}
        self.mu: float | None = None  # running success rate of the samples seen (pooled prior)

    def budget(self, n: int, max_new_tokens: int) -> StepBudget:
        """``budget_samples`` (default: the fixed allocation's want x n) and ``budget_tokens``."""
        return StepBudget(self.k.budget_samples or self.want * n, self.k.budget_tokens or None)

    def prior(self, uid: int) -> tuple[float, float]:
        """The prompt's Beta prior from its history."""
        s_h, f_h = self.history.get(uid, (0.0, 0.0))
        a, b = self.k.prior_a, self.k.prior_b
        if self.k.pooled_strength > 0 and self.mu is not None:
            mu = min(max(self.mu, MU_CLAMP), 1.0 - MU_CLAMP)
            a, b = self.k.pooled_strength * mu, self.k.pooled_strength * (1.0 - mu)
        return a + s_h, b + f_h

    def decide(self, view: PromptView) -> int:
        """Probe, then commit / abandon / one more sample by the two thresholds."""
        k, n = len(view.outcomes), view.n
        s = sum(1 for o in view.outcomes if o > 0.5)
        f = k - s
        if (s > 0 and f > 0) or len(set(view.rewards)) > 1:  # the group already has a gradient
            return n
        if k < self.k.probe:
            return min(self.k.probe, n)
        p_eff = effectiveness(s, f, *self.prior(view.uid), n)
        if p_eff <= self.k.tau_lo:
            return ABANDON
        if p_eff >= self.k.tau_hi:
            return n
        return k + 1

    def end_step(self, step: int, prompts: list[tuple[PromptView, bool]]) -> dict[str, float]:
        """Fold the step's outcomes into each prompt's history; the step's decision counts."""
        d = self.k.history_decay
        history = dict(self.history)  # swapped in whole: a checkpoint read on another thread sees one step
        for view, _committed in prompts:
            s = sum(1 for o in view.outcomes if o > 0.5)
            s_h, f_h = history.get(view.uid, (0.0, 0.0))
            history[view.uid] = [d * s_h + s, d * f_h + (len(view.outcomes) - s)]
        self.history = history
        seen = [o for view, _ in prompts for o in view.outcomes]
        if seen:
            rate = sum(1 for o in seen if o > 0.5) / len(seen)
            self.mu = rate if self.mu is None else d * self.mu + (1.0 - d) * rate
        committed = sum(1 for _, c in prompts if c)
        self.totals = {
            "committed": self.totals["committed"] + committed,
            "abandoned": self.totals["abandoned"] + len(prompts) - committed,
        }
        return {
            "sara/prompts_known": float(len(self.history)),
            "sara/abandoned_total": float(self.totals["abandoned"]),
            "sara/committed_total": float(self.totals["committed"]),
        }

    def state_dict(self) -> dict:
        """The per-prompt history and the totals."""
        return {
            "history": {str(u): list(v) for u, v in self.history.items()},
            "totals": dict(self.totals),
            "mu": self.mu,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``."""
        self.history = {int(u): [float(x) for x in v] for u, v in state["history"].items()}
        self.totals = {k: int(v) for k, v in state["totals"].items()}
        self.mu = None if state["mu"] is None else float(state["mu"])


def build(ctx, knobs: SARAKnobs) -> MethodParts:
    """The run's SARA allocator (rank 0 uses it)."""
    return MethodParts(allocator=SARAAllocator(knobs, ctx.cfg.schedule.prompts_per_step))


SPEC = MethodSpec(
    name="sara",
    summary="SARA: per-prompt Beta posteriors decide to commit, abandon or keep sampling within a budget",
    provenance="reconstructed",
    knobs=SARAKnobs,
    build=build,
)
