"""TrajVal: probe-based task-learnability valuation (formulas: reference/allocation.py, reconstructed).

A short probe run (an ordinary RL run whose eval set holds every task) gives each task k its
held-out sampled accuracy at the start (acc0, the step-0 evaluation) and at the end of the probe
(acc1, its last evaluation), from ``eval/task/<task>/sampled_acc`` in its metrics.jsonl. Then

    gain           D_k = acc1_k - acc0_k
    learnability   l_k = max(0, D_k) / (1 - acc0_k + eps)     (headroom: true; else max(0, D_k))
    shrinkage      l~_k = l_k * n_k / (n_k + n0)               (n_k: the task's eval samples)
    prior          pi_k proportional to (l~_k + eps0)^beta

``python -m megarl.methods.allocation.trajval_cli PROBE_RUN_DIR --out prior.json`` writes the prior.
The ``trajval`` method's prompt chooser (a ``PromptChooser``, built on PAC's) then gives task k
round(p_k B) of each step's B prompts: p = pi (static prior), or with ``online: true`` p_k
proportional to PAC's online probabilities times pi_k (a multiplicative prior on an online
scheduler).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from megarl.methods.allocation.pac import PACAllocator, PACKnobs
from megarl.plugin.allocation import GroupOutcome
from megarl.plugin.spec import MethodParts, MethodSpec

TASK_KEY = "eval/task/"


def learnability(
    acc0: float, acc1: float, n_eval: float, headroom: bool = True, eps: float = 1e-3, n0: float = 0.0
) -> float:
    """l~ = max(0, acc1 - acc0) / (1 - acc0 + eps) (or without the headroom division) times
    n_eval / (n_eval + n0)."""
    gain = max(0.0, acc1 - acc0)
    ell = gain / (1.0 - acc0 + eps) if headroom else gain
    return ell * n_eval / (n_eval + n0) if n0 > 0 else ell


def prior(ell: dict[str, float], beta: float = 1.0, eps0: float = 0.01) -> dict[str, float]:
    """pi_k = (l_k + eps0)^beta / sum_j (l_j + eps0)^beta (task names sorted)."""
    w = {t: (ell[t] + eps0) ** beta for t in sorted(ell)}
    z = sum(w.values())
    return {t: v / z for t, v in w.items()}


def combine(scores: dict[str, float], pi: dict[str, float]) -> dict[str, float]:
    """p_k = s_k pi_k / sum_j s_j pi_j: an online scheduler's scores times the static prior."""
    w = {t: scores[t] * pi[t] for t in sorted(scores)}
    z = sum(w.values())
    if not z > 0:
        raise ValueError(f"scores x prior sum to {z}; need a positive total")
    return {t: v / z for t, v in w.items()}


def endpoint_accuracies(metrics: Path) -> dict[str, tuple[float, float, float]]:
    """task -> (acc0, acc1, eval samples) from a probe run's metrics.jsonl: its first and last
    records with per-task evaluations (errors name the file)."""
    evals = []
    for i, line in enumerate(metrics.read_text().splitlines()):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{metrics}: line {i + 1} is not JSON ({e})") from None
        tasks = {
            k[len(TASK_KEY) : -len("/sampled_acc")]
            for k in rec
            if k.startswith(TASK_KEY) and k.endswith("/sampled_acc")
        }
        if tasks:
            evals.append((rec, tasks))
    if len(evals) < 2:
        raise ValueError(
            f"{metrics}: {len(evals)} evaluation(s) with per-task accuracies (eval/task/<task>/sampled_acc); "
            "the probe run needs two (an eval set of >= 2 tasks, schedule.eval_k > 1, and an evaluation "
            "at step 0 and at its last step)"
        )
    (first, t0), (last, t1) = evals[0], evals[-1]
    if t0 != t1:
        raise ValueError(
            f"{metrics}: the first and last evaluations have different tasks ({sorted(t0)} vs {sorted(t1)})"
        )
    return {
        t: (
            first[f"{TASK_KEY}{t}/sampled_acc"],
            last[f"{TASK_KEY}{t}/sampled_acc"],
            min(first[f"{TASK_KEY}{t}/samples"], last[f"{TASK_KEY}{t}/samples"]),
        )
        for t in sorted(t0)
    }


def value_probe(
    run_dir: Path,
    beta: float = 1.0,
    eps0: float = 0.01,
    n0: float = 0.0,
    headroom: bool = True,
    eps: float = 1e-3,
) -> dict:
    """The prior file's content for the probe run in ``run_dir``."""
    acc = endpoint_accuracies(Path(run_dir) / "metrics.jsonl")
    ell = {t: learnability(a0, a1, n, headroom, eps, n0) for t, (a0, a1, n) in acc.items()}
    pi = prior(ell, beta, eps0)
    return {
        "probe": str(run_dir),
        "knobs": {"beta": beta, "eps0": eps0, "n0": n0, "headroom": headroom, "eps": eps},
        "tasks": {
            t: {"acc0": a0, "acc1": a1, "n_eval": n, "gain": a1 - a0, "learnability": ell[t], "prior": pi[t]}
            for t, (a0, a1, n) in acc.items()
        },
    }


def read_prior(path: str) -> dict[str, float]:
    """task -> prior from a file ``value_probe`` wrote (errors name the file and the field)."""
    p = Path(path)
    if not p.exists():
        raise ValueError(
            f"method.prior={path!r}: no such file "
            "(write it with python -m megarl.methods.allocation.trajval_cli)"
        )
    try:
        tasks = json.loads(p.read_text())["tasks"]
        out = {str(t): float(v["prior"]) for t, v in tasks.items()}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a TrajVal prior file (tasks.<task>.prior): {e!r}") from None
    bad = [t for t, v in out.items() if not (v > 0 and math.isfinite(v))]
    if bad:
        raise ValueError(f"{path}: tasks {bad} have a prior that is not a positive number")
    return out


@dataclass
class TrajValKnobs(PACKnobs):
    """TrajVal's prior file and mode; the PAC knobs drive the online scheduler (``online: true``)."""

    prior: str = ""  # the prior file (python -m megarl.methods.allocation.trajval_cli PROBE_RUN --out FILE)
    online: bool = False  # false: the static prior; true: PAC's probabilities x the prior

    def check(self) -> None:
        """A prior file is named; the PAC knobs are in range."""
        super().check()
        if not self.prior:
            raise ValueError(
                "prior is empty: name the file python -m megarl.methods.allocation.trajval_cli wrote"
            )


class TrajValChooser(PACAllocator):
    """PAC's prompt chooser with the task probabilities replaced by the static prior, or multiplied
    by it (``online``)."""

    def __init__(self, knobs: TrajValKnobs, want: int, pi: dict[str, float]):
        super().__init__(knobs, want)
        self.pi, self.online = pi, knobs.online

    def bind(self, tasks: list[str], seed: int) -> None:
        """PAC's binding; every task of the dataset must have a prior."""
        missing = sorted(set(tasks) - set(self.pi))
        if missing:
            raise ValueError(f"method.prior={self.k.prior!r} has no prior for the dataset's tasks {missing}")  # type: ignore[attr-defined]
        super().bind(tasks, seed)

    def probabilities(self, draws: list[float]) -> list[float]:
        """pi over the dataset's tasks (renormalised), or combined with PAC's online probabilities."""
        pi = {t: self.pi[t] for t in self.rows}
        if self.online:
            scores = dict(zip(self.rows, super().probabilities(draws)))
            return list(combine(scores, pi).values())
        z = sum(pi.values())
        return [v / z for v in pi.values()]

    def observe(self, step: int, groups: list[GroupOutcome]) -> dict[str, float]:
        """PAC's statistics (online) and the step's prompts per task."""
        out = super().observe(step, groups) if self.online else {}
        for t in self.rows:
            out[f"trajval/{t}/prompts"] = float(self.last_counts.get(t, 0))
        return out


def build(ctx, knobs: TrajValKnobs) -> MethodParts:
    """The run's chooser over the prior file's tasks."""
    return MethodParts(
        allocator=TrajValChooser(knobs, ctx.cfg.schedule.prompts_per_step, read_prior(knobs.prior))
    )


SPEC = MethodSpec(
    name="trajval",
    summary="TrajVal: a probe run's per-task learnability as a static prior over the step's prompts",
    provenance="reconstructed",
    knobs=TrajValKnobs,
    build=build,
)
