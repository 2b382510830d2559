"""Rollout-allocation claim runs: a three-task dataset and a report of what each run spent.

    python benchmarks/allocation_claim.py data runs/alloc-data     # copy 3 / reverse 3 / add 2 digits
    python benchmarks/allocation_claim.py report runs/a runs/b --targets 0.07,0.1

``data`` writes ``train.jsonl`` (400 rows per task) and ``eval.jsonl`` (60 per task): a harder
sibling of the quickstart (copy is the easiest task; after the warm-up most reverse and add groups
fail entirely, so many groups have equal rewards).
``report`` reads each run's metrics.jsonl: samples generated, groups with a non-zero gradient
(rewards that differ) and their yield per 1000 samples, the held-out sampled accuracy at each
evaluation against the samples spent so far, the samples spent when it first reached each target.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megarl.data.tasks import generate_task_files

TASKS = (("copy", 3), ("reverse", 3), ("add", 2))


def write_data(out: Path) -> None:
    """The three tasks' train and eval rows, concatenated per split."""
    out.mkdir(parents=True, exist_ok=True)
    parts = {"train": [], "eval": []}
    for task, digits in TASKS:
        tr, ev = out / f"{task}-train.jsonl", out / f"{task}-eval.jsonl"
        generate_task_files(task, tr, ev, num_train=400, num_eval=60, digits=digits, seed=0)
        parts["train"].append(tr.read_text())
        parts["eval"].append(ev.read_text())
    for split, texts in parts.items():
        (out / f"{split}.jsonl").write_text("".join(texts))
    print(f"{out}/train.jsonl, {out}/eval.jsonl")


def report(run_dir: Path, targets: list[float]) -> None:
    """One run's spend, yield and accuracy against samples."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = groups = 0
    evals = []
    for r in recs:
        if r["step"] > 0:
            samples += r.get("budget/samples", 0)
            groups += r.get("budget/groups_effective", 0)
        if "eval/sampled_acc" in r:
            evals.append((r["step"], samples, round(r["eval/sampled_acc"], 3)))
    reach = {t: next((s for _, s, a in evals if a >= t), None) for t in targets}
    print(
        f"{run_dir}: {recs[-1]['step']} steps, {samples} samples, {groups} groups with a gradient "
        f"({1000 * groups / max(samples, 1):.1f} per 1000 samples)"
    )
    print(f"  (step, samples so far, held-out sampled_acc): {evals}")
    print(f"  samples when first reaching {targets}: {[reach[t] for t in targets]}")


def main() -> None:
    """``data OUT`` or ``report RUN_DIR... [--targets a,b]``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["data", "report"])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--targets", default="0.1")
    a = ap.parse_args()
    if a.what == "data":
        write_data(Path(a.paths[0]))
    else:
        for p in a.paths:
            report(Path(p), [float(x) for x in a.targets.split(",")])


if __name__ == "__main__":
    main()
