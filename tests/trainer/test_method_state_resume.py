"""Method state survives checkpoint/resume in the real trainer: a run with three stateful parts (GEPO's
entropy history, EPPO's per-task entropy EMA in the objective, AMRP's reward weights) is resumed
from its step-2 checkpoint and must redo step 3 exactly as the uninterrupted run did. Without the
restored state, GEPO's history and AMRP's weights would restart from the step-3 batch alone."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[2]
pytestmark = pytest.mark.slow

STATEFUL = (
    "adv/gepo_h_mean",
    "adv/gepo_h_std",
    "shaping/amrp/w/correct",
    "shaping/amrp/w/format",
    "train/eppo/clip_scale",
    "train/loss",
    "train/grad_norm",
    "reward/mean",
)


def config(tmp: Path) -> Path:
    d = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    d["advantage"] = {"estimator": "gepo", "k": 0.5, "beta": 0.9}
    d["objective"] = {
        "policy_loss": "eppo",
        "clip_low": 0.2,
        "clip_high": 0.28,
        "aggregation": "token-mean",
        "policy_loss_args": {"num_tasks": 4, "momentum": 0.9},
    }
    d["reward"] = {
        "functions": [
            {"name": "correct", "kind": "exact_match", "correct": True},
            {"name": "format", "kind": "regex", "pattern": r"^\d+$"},
        ],
        "shaping": {"name": "amrp", "eta": 0.5},
    }
    p = tmp / "run.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def train(cfg: Path, tmp: Path, run_dir: Path) -> subprocess.CompletedProcess:
    args = [
        f"logging.run_dir={run_dir}",
        f"data.train={tmp / 'train.jsonl'}",
        f"data.eval={tmp / 'eval.jsonl'}",
        "data.generate.num_train=100",
        "data.generate.num_eval=4",
        "warmup.sft_steps=4",
        "warmup.batch_size=16",
        "schedule.steps=3",
        "schedule.prompts_per_step=4",
        "rollout.n=4",
        "rollout.max_new_tokens=6",
        "schedule.eval_samples=4",
        "schedule.eval_k=1",
        "checkpoint.every=2",
        "checkpoint.keep_last=3",
        "optimizer.lr_warmup_steps=0",
        "logging.plot=false",
    ]
    p = subprocess.run(
        [sys.executable, "-m", "megarl.cli", "train", str(cfg), *args],
        cwd=ROOT,
        check=False,
        env=dict(os.environ, MEGARL_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def metrics(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def resumed_step_3(cfg: Path, tmp: Path, keys: tuple[str, ...], saved: str) -> dict[int, dict]:
    """Train 3 steps; resume a copy from its step-2 checkpoint (``saved``: a file it must hold) and
    check that step 3 is redone exactly in ``keys``; returns the uninterrupted run's metrics."""
    full = tmp / "full"
    train(cfg, tmp, full)
    assert (full / "checkpoints" / "step_000002" / saved).is_file()
    resumed = tmp / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000003")
    p = train(cfg, tmp, resumed)
    assert "resumed from" in p.stdout and "(step 2)" in p.stdout
    a, b = metrics(full)[3], metrics(resumed)[3]
    for k in keys:
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), (k, a[k], b[k])
    return metrics(full)


def test_resume_restores_estimator_objective_and_shaper_state(tmp_path):
    cfg = config(tmp_path)
    m = resumed_step_3(cfg, tmp_path, STATEFUL, "method.pt")
    assert (tmp_path / "full" / "checkpoints" / "step_000002" / "objective.pt").is_file()
    # the state really carried information: GEPO's EMA is not the step-3 batch alone
    assert m[2]["adv/gepo_h_mean"] != m[3]["adv/gepo_h_mean"]


CRITIC = (
    "critic/values_old",
    "critic/value_loss",
    "critic/grad_norm",
    "train/loss",
    "adv/mean",
    "reward/mean",
)


def test_resume_restores_the_critic(tmp_path):
    """ppo_critic: the critic's weights and Adam state are saved in the checkpoint (hook_0/) and loaded
    on resume; step 3 of the resumed run scores and trains exactly as the uninterrupted run."""
    d = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    d["method"] = {"name": "ppo_critic"}
    d["advantage"] = {"estimator": "gae", "gamma": 1.0, "lam": 0.95}
    d["objective"] = {"policy_loss": "ppo", "aggregation": "token-mean"}
    d["inputs"] = {"values": {"lr": 1.0e-3, "bounds": [-1.0, 2.0]}}  # V starts at 0.5, not at R = 0
    cfg = tmp_path / "critic.yaml"
    cfg.write_text(yaml.safe_dump(d))
    m = resumed_step_3(cfg, tmp_path, CRITIC, "hook_0/megarl.json")
    # the critic state carried information: its values moved from the head's initial 0.5
    assert abs(m[3]["critic/values_old"] - m[1]["critic/values_old"]) > 1e-3
