"""PAC: progress-augmented task curriculum (formulas: reference/allocation.py, reconstructed).

A round allocator that picks the step's prompts itself (``PromptChooser``,
megarl/plugin/allocation.py). Per task k it keeps a learnability EMA L_k of the mean |GRPO
advantage| of its samples and a progress EMA P_k of the change of its mean reward between the
steps it is sampled in; each observed step gives the utility u_k = z(L)_k + beta z(P)_k (z:
standardised across tasks), folded into a Gaussian posterior with discounted sufficient statistics
(n_k, s_k <- discount * n_k, discount * s_k; then + (1, u_k)): N(s_k / (n_k + n0), sigma^2 /
(n_k + n0)). Each step draws theta_k from every task's posterior (Thompson sampling, seeded by the
run's seed and the step), sets p = (1 - epsilon) softmax(theta / temperature) + epsilon / K and gives
task k round(p_k B) of the step's B prompts (largest remainder), drawn from a shuffled pass over
the task's rows.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from megarl.advantages.estimators import grpo
from megarl.plugin.allocation import GroupOutcome
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodParts, MethodSpec


@dataclass
class PACKnobs(Knobs):
    """PAC's signals, posterior and sampling (``method`` section)."""

    beta: float = 1.0  # weight of the progress signal (0: learnability-only curriculum)
    ema: float = 0.7  # EMA weight of the old value for L_k and P_k
    discount: float = 0.9  # discount of the posterior's sufficient statistics per step
    clip_progress: bool = False  # P_k clipped at 0 (only gains count)
    sigma: float = 1.0  # observation noise of the utility
    n0: float = 1.0  # prior pseudo-count of the posterior N(0, sigma^2 / n0)
    temperature: float = 1.0
    epsilon: float = 0.1  # uniform floor: every task keeps epsilon / K of the prompts

    def check(self) -> None:
        """ema, epsilon in [0, 1); discount in (0, 1]; sigma, n0, temperature > 0."""
        if not (0.0 <= self.ema < 1.0):
            raise ValueError(f"ema={self.ema} must be in [0, 1)")
        if not (0.0 < self.discount <= 1.0):
            raise ValueError(f"discount={self.discount} must be in (0, 1]")
        if not (0.0 <= self.epsilon <= 1.0):
            raise ValueError(f"epsilon={self.epsilon} must be in [0, 1]")
        for key in ("sigma", "n0", "temperature"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key}={getattr(self, key)} must be > 0")


def task_signals(groups: list[tuple[float, ...]]) -> tuple[float, float]:
    """(mean |GRPO advantage|, mean reward) over one task's groups of a step."""
    rewards = torch.tensor([r for g in groups for r in g], dtype=torch.float64)
    ids = torch.tensor([i for i, g in enumerate(groups) for _ in g])
    return float(grpo(rewards, ids).abs().mean()), float(rewards.mean())


def zscores(values: list[float]) -> list[float]:
    """Across-task standardisation (population std; zeros when the values are all equal)."""
    t = torch.tensor(values, dtype=torch.float64)
    sd = float(t.std(unbiased=False))
    return [0.0] * len(values) if sd == 0 else ((t - t.mean()) / sd).tolist()


def counts_for(probs: list[float], total: int) -> list[int]:
    """Largest-remainder rounding of ``probs * total`` (ties to the lower index)."""
    raw = [p * total for p in probs]
    out = [math.floor(x) for x in raw]
    rest = sorted(range(len(raw)), key=lambda k: (out[k] - raw[k], k))
    for k in rest[: total - sum(out)]:
        out[k] += 1
    return out


class PACAllocator:
    """The curriculum (see the module docstring). ``stats``: task -> {L, P, last, n, s};
    ``cursors``: task -> [epoch, position] of its shuffled pass."""

    def __init__(self, knobs: PACKnobs, want: int):
        self.k, self.want = knobs, want
        self.stats: dict[str, dict] = {}
        self.cursors: dict[str, list[int]] = {}
        self.rows: dict[str, list[int]] = {}
        self.seed = 0
        self.last_counts: dict[str, int] = {}

    # ------------------------------------------------------------------ round allocator
    def keep(self, rewards: torch.Tensor) -> bool:
        """Every group stays."""
        return True

    def more(self, kept: int, rounds: int) -> bool:
        """One round per step."""
        return False

    # ------------------------------------------------------------------ prompt choice
    def bind(self, tasks: list[str], seed: int) -> None:
        """The dataset's rows per task (sorted task names) and the run's seed."""
        self.rows = {}
        for i, t in enumerate(tasks):
            self.rows.setdefault(t, []).append(i)
        self.rows = dict(sorted(self.rows.items()))
        self.seed = seed
        for t in self.rows:
            self.cursors.setdefault(t, [0, 0])

    def posterior(self, task: str) -> tuple[float, float]:
        """(mean, std) of the task's utility posterior."""
        st = self.stats.get(task, {"n": 0.0, "s": 0.0})
        n = st["n"] + self.k.n0
        return st["s"] / n, self.k.sigma / math.sqrt(n)

    def probabilities(self, draws: list[float]) -> list[float]:
        """p_k from standard-normal ``draws`` (one per task, sorted task order)."""
        theta = []
        for t, z in zip(self.rows, draws):
            mu, sd = self.posterior(t)
            theta.append(mu + sd * z)
        w = torch.softmax(torch.tensor(theta, dtype=torch.float64) / self.k.temperature, 0)
        return ((1 - self.k.epsilon) * w + self.k.epsilon / len(theta)).tolist()

    def next_prompts(self, step: int, count: int) -> list[int]:
        """``count`` row ids: Thompson draw, task counts, each task's next rows."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 7_919)
        draws = torch.randn(len(self.rows), generator=gen, dtype=torch.float64).tolist()
        counts = counts_for(self.probabilities(draws), count)
        self.last_counts = dict(zip(self.rows, counts))
        return [uid for t, c in self.last_counts.items() for uid in self._take(t, c)]

    def _take(self, task: str, count: int) -> list[int]:
        rows, cur = self.rows[task], self.cursors[task]
        out: list[int] = []
        ti = list(self.rows).index(task)
        while len(out) < count:
            order = list(rows)
            random.Random(self.seed * 1_000_003 + ti * 7_919 + cur[0]).shuffle(order)
            take = min(count - len(out), len(order) - cur[1])
            out += order[cur[1] : cur[1] + take]
            cur[1] += take
            if cur[1] >= len(order):
                cur[0], cur[1] = cur[0] + 1, 0
        return out

    def observe(self, step: int, groups: list[GroupOutcome]) -> dict[str, float]:
        """Fold the step's groups into each task's signals and posterior; metrics per task."""
        k = self.k
        by_task: dict[str, list[tuple[float, ...]]] = {}
        for g in groups:
            by_task.setdefault(g.task, []).append(g.rewards)
        stats = {t: dict(v) for t, v in self.stats.items()}
        for t, gs in by_task.items():
            abs_adv, reward = task_signals(gs)
            st = stats.setdefault(t, {"L": None, "P": 0.0, "last": None, "n": 0.0, "s": 0.0})
            st["L"] = abs_adv if st["L"] is None else k.ema * st["L"] + (1 - k.ema) * abs_adv
            if st["last"] is not None:
                st["P"] = k.ema * st["P"] + (1 - k.ema) * (reward - st["last"])
                if k.clip_progress:
                    st["P"] = max(st["P"], 0.0)
            st["last"] = reward
        known = sorted(t for t in stats if stats[t]["L"] is not None)
        zl = dict(zip(known, zscores([stats[t]["L"] for t in known]))) if known else {}
        zp = dict(zip(known, zscores([stats[t]["P"] for t in known]))) if known else {}
        for t, st in stats.items():
            st["n"], st["s"] = k.discount * st["n"], k.discount * st["s"]
            if t in by_task:
                st["n"] += 1.0
                st["s"] += zl[t] + k.beta * zp[t]
        self.stats = stats  # swapped in whole: a checkpoint read on another thread sees one step
        out: dict[str, float] = {}
        for t in self.rows:
            out[f"pac/{t}/prompts"] = float(self.last_counts.get(t, 0))
            out[f"pac/{t}/utility_mean"] = self.posterior(t)[0]
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Per-task statistics and row cursors."""
        return {
            "stats": {t: dict(v) for t, v in self.stats.items()},
            "cursors": {t: list(v) for t, v in self.cursors.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``."""
        self.stats = {t: dict(v) for t, v in state["stats"].items()}
        self.cursors = {t: [int(x) for x in v] for t, v in state["cursors"].items()}


def build(ctx, knobs: PACKnobs) -> MethodParts:
    """The run's PAC curriculum (rank 0 uses it)."""
    return MethodParts(allocator=PACAllocator(knobs, ctx.cfg.schedule.prompts_per_step))


SPEC = MethodSpec(
    name="pac",
    summary="PAC: Thompson sampling over tasks on advantage-derived learnability and reward progress",
    provenance="reconstructed",
    knobs=PACKnobs,
    build=build,
)
