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


def test_resume_restores_estimator_objective_and_shaper_state(tmp_path):
    cfg = config(tmp_path)
    full = tmp_path / "full"
    train(cfg, tmp_path, full)
    ckpt = full / "checkpoints"
    assert (ckpt / "step_000002" / "method.pt").is_file() and (
        ckpt / "step_000002" / "objective.pt"
    ).is_file()
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000003")
    p = train(cfg, tmp_path, resumed)
    assert "resumed from" in p.stdout and "(step 2)" in p.stdout
    a, b = metrics(full)[3], metrics(resumed)[3]
    for k in STATEFUL:
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), (k, a[k], b[k])
    # the state really carried information: GEPO's EMA is not the step-3 batch alone
    assert metrics(full)[2]["adv/gepo_h_mean"] != a["adv/gepo_h_mean"]


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
    full = tmp_path / "full"
    train(cfg, tmp_path, full)
    assert (full / "checkpoints" / "step_000002" / "hook_0" / "megarl.json").is_file()
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000003")
    p = train(cfg, tmp_path, resumed)
    assert "resumed from" in p.stdout and "(step 2)" in p.stdout
    a, b = metrics(full)[3], metrics(resumed)[3]
    for k in CRITIC:
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), (k, a[k], b[k])
    # the critic state carried information: its values moved from the head's initial 0.5
    assert abs(a["critic/values_old"] - metrics(full)[1]["critic/values_old"]) > 1e-3
