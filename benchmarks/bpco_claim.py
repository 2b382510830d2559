"""BPCO's toy-scale claim check: one rollout per prompt with the critic against GRPO with a group of 8,
the same 64 samples per step, seed and number of steps, on the CPU quickstart task.

    .venv/bin/python benchmarks/bpco_claim.py --out runs/bpco-claim [--steps 30]

Runs (each a ``megarl train`` in a subprocess, in its own run directory under ``--out``):
``bpco`` (examples/methods/bpco.yaml, α = 0.4), ``bpco-alpha4`` (the same with
``advantage.lam_alpha=4.0``) and ``grpo8`` (examples/quickstart.yaml with 8 prompts x 8 samples, no
KL). Writes ``summary.json`` (held-out sampled accuracy and pass@k per evaluation, wall time) and
``bpco-claim.png`` (held-out sampled accuracy and training accuracy per step).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from claim_runs import plot, read, train

RUNS = {
    "bpco": ["examples/methods/bpco.yaml"],
    "bpco-alpha4": ["examples/methods/bpco.yaml", "advantage.lam_alpha=4.0"],
    "grpo8": ["examples/quickstart.yaml", "schedule.prompts_per_step=8", "objective.kl_coef=0"],
}
LABELS = {"bpco": "BPCO α=0.4 (64 x 1)", "bpco-alpha4": "BPCO α=4 (64 x 1)", "grpo8": "GRPO (8 x 8)"}


def main() -> None:
    """Run the three trainings, then write summary.json and bpco-claim.png."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bpco-claim")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--only", default="", help="comma-separated run names (default: all)")
    ap.add_argument("--plot-only", action="store_true", help="re-read existing runs, do not train")
    a = ap.parse_args()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in (a.only.split(",") if a.only else RUNS) if n]
    wall = {} if a.plot_only else {n: train(n, RUNS[n], out, a.steps) for n in names}
    records = {n: read(out / n) for n in names}
    keys = ("eval/sampled_acc", "eval/pass@1", "eval/pass@4")
    summary = {
        n: {
            "wall_s": wall.get(n),
            "evals": [{"step": r["step"], **{k: r[k] for k in keys if k in r}} for r in recs if keys[0] in r],
        }
        for n, recs in records.items()
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(records, out / "bpco-claim.png", LABELS)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
