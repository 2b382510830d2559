"""megarl against TRL's GRPOTrainer on the quickstart task, side by side from one invocation.

    bash benchmarks/peers/setup_trl.sh                                  # once: .venv-trl
    .venv/bin/python benchmarks/peers/compare_trl.py                    # 100 steps x 3 seeds each
    .venv/bin/python benchmarks/peers/compare_trl.py --steps 10 --seeds 1 --eval-every 5 --eval-samples 32

The task (docs/benchmarks.md has the key-by-key mapping): the quickstart's reverse-a-3-digit-string
prompts (examples/data/reverse3-*.jsonl), a 4-layer Qwen3 (hidden 128, character tokenizer), GRPO with
16 prompts x 8 samples, at most 4 new tokens, temperature 1, lr 1e-4 constant, no KL, token-mean loss,
group-scaled rewards, clip 0.2, one optimizer step per batch, reward = the quickstart's verifier (exact
match). Both start from the same HF checkpoint: the quickstart's supervised warm-up (``--warmup-steps``
steps, run once by ``megarl train`` and written as its ``init_policy/``, with the character tokenizer
saved beside it), so the first samples are sometimes right.

Each run is its own process, one after the other (``os.wait4`` gives its CPU seconds, peak RSS and
context switches, children included); ``--seeds`` runs of each side with seeds 0, 1, ... Printed per
side: median s/step (steps after the first, evaluation excluded; median over the seeds of each run's
median), median CPU s/step, CPU seconds and wall seconds of the whole process, peak RSS, voluntary
context switches, the held-out accuracy curve (``eval/sampled_acc``: ``--eval-k`` samples per prompt at
temperature 1 on ``--eval-samples`` held-out prompts, mean and range over the seeds), the step time
summed up to the first evaluation at or above ``--target`` (median over the seeds that reach it), and
megarl / TRL ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from step_speed import run_measured  # noqa: E402

QUICKSTART = ROOT / "examples/quickstart.yaml"
DEFAULT_TRL_PYTHON = ROOT / ".venv-trl/bin/python"


def task_overrides(a: argparse.Namespace) -> list[str]:
    """``megarl train`` overrides shared by the warm-up run and the RL runs."""
    return [
        "model.hf_config.num_hidden_layers=4",
        f"rollout.max_new_tokens={a.max_new_tokens}",
        f"rollout.n={a.n}",
        f"schedule.prompts_per_step={a.prompts}",
        "checkpoint.every=100000",
        "checkpoint.resume=never",
        "checkpoint.on_existing=overwrite",
        "logging.plot=false",
        "logging.progress=lines",
    ]


def rl_overrides(a: argparse.Namespace, init: Path, seed: int, run_dir: Path) -> list[str]:
    """The GRPO keys of the task (the megarl column of the mapping table in docs/benchmarks.md)."""
    return task_overrides(a) + [
        f"model.hf_dir={init}",
        "warmup.sft_steps=0",
        "advantage.estimator=grpo",
        "advantage.scale_by_std=true",
        "objective.policy_loss=ppo",
        "objective.kl_coef=0.0",
        "objective.aggregation=token-mean",
        f"objective.clip_low={a.clip}",
        f"objective.clip_high={a.clip}",
        f"optimizer.lr={a.lr}",
        "optimizer.lr_warmup_steps=0",
        "optimizer.clip_grad=1.0",
        "optimizer.weight_decay=0.0",
        "schedule.ppo_epochs=1",
        "schedule.mini_batches=1",
        f"schedule.steps={a.steps}",
        f"schedule.eval_every={a.eval_every}",
        f"schedule.eval_samples={a.eval_samples}",
        f"schedule.eval_k={a.eval_k}",
        f"schedule.seed={seed}",
        f"logging.run_dir={run_dir}",
    ]


def env_for(threads: int) -> dict:
    """The environment of every measured process: ``threads`` torch / OpenMP threads."""
    return dict(
        os.environ, MEGARL_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT)
    )


def prepare_init(a: argparse.Namespace, work: Path) -> Path:
    """The shared start: the quickstart's warm-up as ``megarl train`` runs it (one RL step after it,
    the least a run does), its ``init_policy/`` copied with the character tokenizer beside it."""
    from megarl.data.hf_char_tokenizer import save_hf_char_tokenizer
    from megarl.data.tokenizer import CharTokenizer

    init = work / "init"
    if (init / "tokenizer.json").exists():
        return init
    run_dir = work / "warmup_run"
    cmd = [sys.executable, "-m", "megarl.cli", "train", str(QUICKSTART)]
    cmd += task_overrides(a) + [
        f"warmup.sft_steps={a.warmup_steps}",
        "schedule.steps=1",
        "schedule.eval_samples=1",  # the warm-up run's own evaluations: one greedy prompt
        "schedule.eval_k=1",
        f"logging.run_dir={run_dir}",
    ]
    run_measured(cmd, env_for(a.threads), work / "warmup.log")
    shutil.copytree(run_dir / "init_policy", init)
    save_hf_char_tokenizer(CharTokenizer(alphabet_of_quickstart()), init)
    return init


def alphabet_of_quickstart() -> str:
    """The character tokenizer's alphabet as examples/quickstart.yaml sets it."""
    import yaml

    return yaml.safe_load(QUICKSTART.read_text())["model"]["alphabet"]


def run_megarl(a: argparse.Namespace, init: Path, seed: int, work: Path) -> dict:
    """One ``megarl train`` run; process figures, per-step times, evaluations."""
    run_dir = work / f"megarl_seed{seed}"
    metrics = run_dir / "metrics.jsonl"

    def steps_done() -> int:  # records after step 0's evaluation
        try:
            return max(0, len(metrics.read_text().splitlines()) - 1)
        except OSError:
            return 0

    cmd = [sys.executable, "-m", "megarl.cli", "train", str(QUICKSTART)]
    cmd += rl_overrides(a, init, seed, run_dir) + a.megarl_arg
    res = run_measured(cmd, env_for(a.threads), work / f"megarl_seed{seed}.log", steps_done)
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    evals = {r["step"] for r in recs if "eval/sampled_acc" in r}
    marks = dict(res["marks"])
    # CPU of one step: consecutive marks one step apart, the later one not an evaluation step
    cpu = [marks[s] - marks[s - 1] for s in marks if s - 1 in marks and s >= 2 and s not in evals]
    steps = [{"step": r["step"], "wall_s": r["time/step"]} for r in recs if "time/step" in r]
    return finish(res, steps, cpu, [r for r in recs if "eval/sampled_acc" in r])


def run_trl(a: argparse.Namespace, init: Path, seed: int, work: Path) -> dict:
    """One TRL GRPOTrainer run (benchmarks/peers/trl_grpo.py in the TRL venv)."""
    out = work / f"trl_seed{seed}.json"
    cmd = [str(a.trl_python), str(Path(__file__).with_name("trl_grpo.py")), "--init", str(init)]
    cmd += ["--steps", str(a.steps), "--seed", str(seed), "--threads", str(a.threads)]
    cmd += ["--prompts", str(a.prompts), "--n", str(a.n), "--max-new-tokens", str(a.max_new_tokens)]
    cmd += ["--lr", str(a.lr), "--clip", str(a.clip), "--eval-every", str(a.eval_every)]
    cmd += ["--eval-samples", str(a.eval_samples), "--eval-k", str(a.eval_k)]
    cmd += ["--work", str(work / f"trl_seed{seed}"), "--out", str(out)]
    cmd += [x for kv in a.trl_arg for x in ("--trl-arg", kv)]
    res = run_measured(cmd, env_for(a.threads), work / f"trl_seed{seed}.log")
    rec = json.loads(out.read_text())
    cpu = [s["cpu_s"] for s in rec["steps"] if s["step"] >= 2]
    return finish(res, rec["steps"], cpu, rec["evals"])


def finish(res: dict, steps: list[dict], cpu: list[float], evals: list[dict]) -> dict:
    """A run's summary: median s/step and CPU s/step (steps >= 2), cumulative step time at each
    evaluation, the accuracy curve."""
    later = [s["wall_s"] for s in steps if s["step"] >= 2] or [s["wall_s"] for s in steps]
    cum, t = {0: 0.0}, 0.0
    for s in sorted(steps, key=lambda s: s["step"]):
        t += s["wall_s"]
        cum[s["step"]] = t
    return {
        "s_per_step": statistics.median(later),
        "cpu_per_step": statistics.median(cpu) if cpu else float("nan"),
        "cpu_s": res["cpu_s"],
        "wall_s": res["wall_s"],
        "peak_rss_mib": res["peak_rss_mib"],
        "vol_ctx": res["vol_ctx"],
        "threads": res["threads"],  # thread name -> [threads, voluntary switches, CPU s] (last seen)
        "curve": {int(e["step"]): float(e["eval/sampled_acc"]) for e in evals},
        "step_time_at": cum,
    }


def time_to(run: dict, target: float) -> float | None:
    """Summed step time up to the first evaluation at or above ``target`` (None: never)."""
    for step in sorted(run["curve"]):
        if run["curve"][step] >= target:
            return run["step_time_at"].get(step, 0.0)
    return None


def summary(runs: list[dict], target: float) -> dict:
    """One side's figures over its seeds."""
    reach = [t for t in (time_to(r, target) for r in runs) if t is not None]
    steps = sorted(set.intersection(*(set(r["curve"]) for r in runs)))
    return {
        "s_per_step": statistics.median(r["s_per_step"] for r in runs),
        "cpu_per_step": statistics.median(r["cpu_per_step"] for r in runs),
        "cpu_s": statistics.median(r["cpu_s"] for r in runs),
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
        "vol_ctx": statistics.median(r["vol_ctx"] for r in runs),
        "threads": runs[0]["threads"],
        "time_to_target": statistics.median(reach) if reach else None,
        "reached": len(reach),
        "curve": {s: [r["curve"][s] for r in runs] for s in steps},
    }


def report(m: dict, t: dict, a: argparse.Namespace) -> None:
    """Print both sides' figures and megarl / TRL."""

    def row(name: str, mv, tv, fmt: str = "{:.3f}") -> None:
        show = lambda v: "-" if v is None else fmt.format(v)  # noqa: E731
        ratio = f"{mv / tv:.2f}x" if mv is not None and tv else "-"
        print(f"{name:<40} {show(mv):>10} {show(tv):>10} {ratio:>8}")

    print(f"{'':<40} {'megarl':>10} {'TRL':>10} {'ratio':>8}")
    row("median s/step (steps >= 2, no eval)", m["s_per_step"], t["s_per_step"])
    row("median CPU s/step", m["cpu_per_step"], t["cpu_per_step"])
    row("CPU s, whole process", m["cpu_s"], t["cpu_s"], "{:.1f}")
    row("wall s, whole process", m["wall_s"], t["wall_s"], "{:.1f}")
    row("peak RSS MiB", m["peak_rss_mib"], t["peak_rss_mib"], "{:.0f}")
    row("voluntary ctx switches", m["vol_ctx"], t["vol_ctx"], "{:.0f}")
    for name, side in (("megarl", m), ("TRL", t)):
        top = sorted(side["threads"].items(), key=lambda kv: -kv[1][1])[:4]
        print(
            f"  {name} threads by voluntary ctx switches (seed 0; name x threads): "
            + ", ".join(f"{n} x{k:.0f} {c:.0f}" for n, (k, c, _) in top)
        )
    row(f"step time to sampled_acc >= {a.target}", m["time_to_target"], t["time_to_target"], "{:.1f}")
    print(f"  seeds reaching it: megarl {m['reached']}/{a.seeds}, TRL {t['reached']}/{a.seeds}")
    print("held-out sampled_acc (mean [min, max] over seeds):")
    for s in sorted(set(m["curve"]) | set(t["curve"])):
        cells = []
        for side in (m, t):
            v = side["curve"].get(s)
            cells.append(f"{statistics.mean(v):.3f} [{min(v):.3f}, {max(v):.3f}]" if v else "-")
        print(f"  step {s:>4}   megarl {cells[0]:<24} TRL {cells[1]}")


def main() -> None:
    """Parse the arguments, prepare the shared start, run both sides per seed, print the comparison."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seeds", type=int, default=3, help="runs of each side (seeds 0..N-1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each side")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--warmup-steps", type=int, default=22, help="supervised steps of the shared start")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-samples", type=int, default=200)
    ap.add_argument("--eval-k", type=int, default=4)
    ap.add_argument("--target", type=float, default=0.5, help="held-out sampled_acc of the time-to-target")
    ap.add_argument("--trl-python", default=str(DEFAULT_TRL_PYTHON), help="python of the TRL venv")
    ap.add_argument("--megarl-arg", action="append", default=[], help="extra megarl override (repeatable)")
    ap.add_argument("--trl-arg", action="append", default=[], help="extra GRPOConfig key=JSON (repeatable)")
    ap.add_argument("--workdir", help="where runs and logs go (default: a temporary directory)")
    ap.add_argument("--json", help="also write every figure to this file")
    a = ap.parse_args()
    if not Path(a.trl_python).exists():
        sys.exit(f"compare_trl: no TRL venv at {a.trl_python}; run: bash benchmarks/peers/setup_trl.sh")
    work = Path(a.workdir or tempfile.mkdtemp(prefix="megarl-vs-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    init = prepare_init(a, work)
    runs: dict[str, list[dict]] = {"megarl": [], "trl": []}
    for seed in range(a.seeds):
        runs["megarl"].append(run_megarl(a, init, seed, work))
        runs["trl"].append(run_trl(a, init, seed, work))
    m, t = summary(runs["megarl"], a.target), summary(runs["trl"], a.target)
    print(
        f"{a.steps} steps x {a.seeds} seed(s) per side, {a.threads} torch thread(s), "
        f"load average {load:.1f} at start, {os.getloadavg()[0]:.1f} at end; logs in {work}"
    )
    report(m, t, a)
    if a.json:
        Path(a.json).write_text(json.dumps({"megarl": m, "trl": t, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
