"""Shared parts of the toy-scale claim scripts that train through ``megarl train`` (critics_claim.py,
bpco_claim.py, distill_claim.py): one training per run name in a subprocess, its metrics, and the
accuracy figure. Not a benchmark of its own: running this file does nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train(name: str, args: list[str], out: Path, steps: int | None = None) -> float:
    """Run one training (``args``: the config, then overrides) to completion in ``out/name`` (log:
    ``out/name.log``), ``steps`` RL steps unless None; its wall time in seconds."""
    run_dir = out / name
    cmd = [sys.executable, "-m", "megarl.cli", "train", *args]
    cmd += [] if steps is None else [f"schedule.steps={steps}"]
    cmd += [f"logging.run_dir={run_dir}", "checkpoint.resume=never", "checkpoint.on_existing=overwrite"]
    t0 = time.time()
    with open(out / f"{name}.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    return time.time() - t0


def read(run_dir: Path) -> list[dict]:
    """The run's metrics records."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def plot(records: dict[str, list[dict]], path: Path, labels: dict[str, str] | None = None) -> None:
    """Held-out sampled accuracy per evaluation and training accuracy per step, one line per run
    (``labels``: legend text per run name, default the name)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or {}
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, recs in records.items():
        ev = [(r["step"], r["eval/sampled_acc"]) for r in recs if "eval/sampled_acc" in r]
        a.plot(*zip(*ev), marker="o", label=labels.get(name, name))
        tr = [(r["step"], r["rollout/accuracy"]) for r in recs if "rollout/accuracy" in r]
        b.plot(*zip(*tr), label=labels.get(name, name), alpha=0.8)
    a.set(title="held-out sampled accuracy", xlabel="RL step (64 samples each)")
    b.set(title="training accuracy (the step's samples)", xlabel="RL step")
    a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
