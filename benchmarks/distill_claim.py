"""Toy-scale claim check of the teacher-shaped methods (Distilled RL, OPD regulation, RA-OPD, OPDVR,
GRPD) against plain GRPO and plain on-policy distillation, on the CPU quickstart task.

    .venv/bin/python benchmarks/distill_claim.py --out runs/distill-claim [--steps 8] [--only grpo,opd]

1. A teacher: the quickstart model after ``--teacher-sft`` supervised warm-up steps (megarl's own
   warm-up; its ``init_policy/`` is an HF checkpoint), run as ``megarl train`` with one RL step;
   its held-out accuracy is that run's step-0 evaluation (an existing teacher under ``--out`` is reused).
2. A less-trained student: the same architecture after ``--student-sft`` warm-up steps (same seed, so
   every run starts from the same weights), trained ``--steps`` RL steps with each method at the same
   seed, prompts and samples per step (``--prompts-per-step`` x 8) and evaluation schedule.

Each run is a ``megarl train`` subprocess in its own run directory under ``--out``. Prints and writes
``summary.json``: per run the held-out sampled accuracy (T=1) and pass@1 (greedy) at every
evaluation, the generated tokens up to it, the tokens to first reach ``--target`` sampled accuracy,
and the wall time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from claim_runs import read, train

NO_KL = "objective.kl_coef=0.0"
# name -> (config, needs the teacher, extra overrides)
RUNS: dict[str, tuple[str, bool, list[str]]] = {
    "grpo": ("examples/quickstart.yaml", False, [NO_KL]),
    "opd": ("examples/methods/core-onpolicy-distill.yaml", True, [NO_KL]),
    "distilled_rl": ("examples/methods/distilled-rl.yaml", True, []),
    "opd_regulation": ("examples/methods/opd-regulation.yaml", True, []),
    "ra_opd": ("examples/methods/ra-opd.yaml", True, []),
    "opdvr": ("examples/methods/opdvr.yaml", True, []),
    "grpd": ("examples/methods/grpd.yaml", True, []),
    "rstg": ("examples/methods/rstg.yaml", True, [NO_KL]),
    "self_routing": ("examples/methods/self-routing.yaml", False, [NO_KL]),
    "skald": ("examples/methods/skald.yaml", True, [NO_KL]),
}


def curve(records: list[dict]) -> list[dict]:
    """Per evaluation: step, generated tokens up to that step, sampled accuracy, greedy pass@1."""
    tokens, out = 0, []
    for r in sorted(records, key=lambda r: r["step"]):
        tokens += int(r.get("budget/tokens", 0))
        if "eval/sampled_acc" in r:
            out.append(
                {
                    "step": r["step"],
                    "tokens": tokens,
                    "sampled_acc": r["eval/sampled_acc"],
                    "pass@1": r.get("eval/pass@1"),
                }
            )
    return out


def tokens_to(points: list[dict], target: float) -> int | None:
    """Generated tokens at the first evaluation whose sampled accuracy reaches ``target`` (None: never)."""
    return next((p["tokens"] for p in points if p["sampled_acc"] >= target), None)


def main() -> None:
    """Train the teacher, then every selected student run; print and write the summary."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/distill-claim")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts-per-step", type=int, default=8, help="x rollout.n = 8 samples each")
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--eval-samples", type=int, default=64)
    ap.add_argument("--teacher-sft", type=int, default=150)
    ap.add_argument("--student-sft", type=int, default=22)
    ap.add_argument("--target", type=float, default=0.4, help="sampled accuracy for 'tokens to reach'")
    ap.add_argument("--only", default="", help="comma-separated run names (default: all)")
    a = ap.parse_args()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    evals = [f"schedule.eval_samples={a.eval_samples}", "schedule.eval_k=4", "checkpoint.every=1000"]
    evals += ["logging.plot=false"]
    teacher_dir = out / "teacher" / "init_policy"
    summary: dict = {"settings": vars(a)}
    if (out / "summary.json").exists():  # runs of an earlier call (with --only) are kept
        summary = {**json.loads((out / "summary.json").read_text()), "settings": vars(a)}
    t_wall = 0.0
    if not (teacher_dir / "config.json").exists():  # a teacher of an earlier call is reused
        t_wall = train(
            "teacher",
            ["examples/quickstart.yaml", f"warmup.sft_steps={a.teacher_sft}", "schedule.steps=1"]
            + ["schedule.eval_every=1", *evals],
            out,
        )
    summary["teacher"] = {"eval": curve(read(out / "teacher"))[0], "wall_s": round(t_wall, 1)}
    student = [f"warmup.sft_steps={a.student_sft}", f"schedule.steps={a.steps}"]
    student += [f"schedule.prompts_per_step={a.prompts_per_step}"]
    student += [f"schedule.eval_every={a.eval_every}", *evals]
    names = [n for n in (a.only.split(",") if a.only else RUNS) if n]
    for name in names:
        config, needs_teacher, extra = RUNS[name]
        teacher = [f"teacher.hf_dir={teacher_dir}"] if needs_teacher else []
        wall = train(name, [config, *student, *teacher, *extra], out)
        points = curve(read(out / name))
        reach = tokens_to(points, a.target)
        summary[name] = {"evals": points, "tokens_to_target": reach, "wall_s": round(wall, 1)}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    t = summary["teacher"]["eval"]
    print(
        f"teacher ({a.teacher_sft} SFT steps): sampled_acc {t['sampled_acc']:.3f}, pass@1 {t['pass@1']:.3f}"
    )
    print(f"| run | sampled_acc per eval (step: acc) | final pass@1 | tokens to {a.target} | wall s |")
    print("|---|---|---|---|---|")
    for name in [n for n in RUNS if n in summary]:
        s = summary[name]
        accs = ", ".join(f"{p['step']}: {p['sampled_acc']:.3f}" for p in s["evals"])
        last = s["evals"][-1]["pass@1"]
        print(f"| {name} | {accs} | {last:.3f} | {s['tokens_to_target']} | {s['wall_s']} |")


if __name__ == "__main__":
    main()
