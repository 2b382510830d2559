"""Toy-scale claim checks of CompPO and SAPO on the CPU quickstart task: each against its baseline,
the same seed, 64 samples per step (64 prompts x 1) and number of steps.

    .venv/bin/python benchmarks/critics_claim.py --method comppo --out runs/comppo-claim [--steps 30]
    .venv/bin/python benchmarks/critics_claim.py --method sapo --out runs/sapo-claim [--steps 30]

Runs (each a ``megarl train`` in a subprocess, in its own run directory under ``--out``):

- comppo: ``comppo`` (examples/methods/comppo.yaml: Comp-GAE on the TAC head), ``gae`` (the same
  with ``advantage.g_min=1.0``: a constant gate of 1, plain GAE on the same head), ``shuffled``
  (the gates permuted within each response, the spec's ablation);
- sapo: ``sapo`` (examples/methods/sapo.yaml), ``ppo-critic`` (examples/methods/ppo-critic.yaml
  with no KL term, as SAPO's example: PPO with a second, Megatron critic model).

Writes ``summary.json`` (held-out sampled accuracy and pass@k per evaluation, mean step time,
wall time) and ``<method>-claim.png`` (held-out sampled accuracy and training accuracy per step).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from claim_runs import plot, read, train

RUNS = {
    "comppo": {
        "comppo": ["examples/methods/comppo.yaml"],
        "gae": ["examples/methods/comppo.yaml", "advantage.g_min=1.0"],
        "shuffled": ["examples/methods/comppo.yaml", "advantage.shuffle=true"],
    },
    "sapo": {
        "sapo": ["examples/methods/sapo.yaml"],
        "ppo-critic": ["examples/methods/ppo-critic.yaml", "objective.kl_coef=0"],
    },
}


def main() -> None:
    """Run the method's trainings, then write summary.json and the figure."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", choices=sorted(RUNS), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--only", default="", help="comma-separated run names (default: all)")
    ap.add_argument("--plot-only", action="store_true", help="re-read existing runs, do not train")
    a = ap.parse_args()
    runs = RUNS[a.method]
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in (a.only.split(",") if a.only else runs) if n]
    wall = {} if a.plot_only else {n: train(n, runs[n], out, a.steps) for n in names}
    records = {n: read(out / n) for n in names if (out / n / "metrics.jsonl").exists()}
    keys = ("eval/sampled_acc", "eval/pass@1", "eval/pass@4")
    summary = {}
    for n, recs in records.items():
        steps = [r["time/step"] for r in recs if "time/step" in r]
        summary[n] = {
            "wall_s": wall.get(n),
            "mean_step_s": sum(steps) / len(steps) if steps else None,
            "evals": [{"step": r["step"], **{k: r[k] for k in keys if k in r}} for r in recs if keys[0] in r],
        }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(records, out / f"{a.method}-claim.png")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
