"""Family-2 example configs in the real trainer: every example's advantage/objective sections are
accepted by the trainer's config loader when spliced into the quickstart config, and a 2-step run of
the quickstart task (real megatron-core learner, embedded engine) trains with SoftmaxGRPO advantages
and the TACO loss (the entropy reaches the loss through the learner's vocab-parallel logits)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megarl.trainer.config import from_dict

ROOT = Path(__file__).parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
FAMILY2 = ["softmax-grpo", "taco", "gepo", "dash", "gigpo", "pgpo", "rspo", "reward-floor", "amrp",
           "rubric-dropout", "cedar-grpo", "care", "rrpo"]


def spliced(name: str) -> dict:
    """The quickstart config with the example's sections: advantage/objective replaced, the other
    sections (reward.shaping, reward.functions, credit) merged key by key."""
    d = yaml.safe_load(QUICKSTART.read_text())
    ex = yaml.safe_load((ROOT / "examples" / "methods" / f"{name}.yaml").read_text())
    for k, v in ex.items():
        if k in ("advantage", "objective"):
            d[k] = v
        else:
            d.setdefault(k, {}).update(v)
    return d


@pytest.mark.parametrize("name", FAMILY2)
def test_trainer_config_loader_accepts_the_example(name):
    cfg = from_dict(spliced(name))
    assert cfg.advantage.estimator == yaml.safe_load((ROOT / "examples" / "methods" / f"{name}.yaml").read_text()
                                                     )["advantage"]["estimator"]


@pytest.mark.slow
def test_two_step_quickstart_run_with_softmax_grpo_and_taco(tmp_path):
    d = spliced("taco")
    d["advantage"] = yaml.safe_load((ROOT / "examples" / "methods" / "softmax-grpo.yaml").read_text())["advantage"]
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(d))
    run_dir = tmp_path / "run"
    args = [f"logging.run_dir={run_dir}", f"data.train={tmp_path / 'train.jsonl'}", f"data.eval={tmp_path / 'eval.jsonl'}",
            "data.generate.num_train=100", "data.generate.num_eval=8", "warmup.sft_steps=2", "warmup.batch_size=16",
            "schedule.steps=2", "schedule.prompts_per_step=4", "rollout.n=4", "schedule.eval_samples=4",
            "schedule.eval_k=1", "schedule.eval_every=0", "checkpoint.every=2", "logging.plot=false"]
    p = subprocess.run([sys.executable, "-m", "megarl.cli", "train", str(cfg_path), *args], cwd=ROOT,
                       env=dict(os.environ, MEGARL_NUM_THREADS="1", PYTHONPATH=str(ROOT)), capture_output=True,
                       text=True, timeout=480)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r.get("step", 0) >= 1 and "train/loss" in r]
    assert len(steps) == 2 and all(abs(r["train/loss"]) < 1e3 for r in steps)
