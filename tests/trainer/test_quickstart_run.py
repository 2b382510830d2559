"""End-to-end runs of the quickstart config, shrunk: the real learner (megatron-core, gloo), the
embedded engine, GRPO from examples/methods/core-grpo.yaml.

- a short run writes everything a run must write (resolved config, metrics, checkpoints, plot);
- a run killed with SIGKILL after its first checkpoint, then started again, resumes from that
  checkpoint and reproduces the uninterrupted run's metrics step for step;
- the newest checkpoint's shard file cut short: the resume skips it (naming the file), continues
  from the one before and redoes the step;
- ``checkpoint.resume: never`` into a used run directory is refused with a message naming it, and
  with ``checkpoint.on_existing: archive`` the old run moves aside and a new run starts from its own
  warm-up (its first checkpoint kept, its metrics its own).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
pytestmark = pytest.mark.slow

# Metrics that depend only on the data, the samples and the weights (not on timing).
DETERMINISTIC = (
    "reward/mean",
    "reward/std",
    "train/loss",
    "train/pg_loss",
    "train/kl",
    "train/entropy",
    "train/grad_norm",
    "adv/std",
    "rollout/response_len",
)


def overrides(tmp: Path, run_dir: Path, steps: int) -> list[str]:
    return [
        f"logging.run_dir={run_dir}",
        f"data.train={tmp / 'train.jsonl'}",
        f"data.eval={tmp / 'eval.jsonl'}",
        "data.generate.num_train=300",
        "data.generate.num_eval=16",
        "data.generate.digits=3",
        "warmup.sft_steps=2",
        "warmup.batch_size=16",
        f"schedule.steps={steps}",
        "schedule.prompts_per_step=4",
        "schedule.mini_batches=2",
        "rollout.n=4",
        "schedule.eval_samples=8",
        "schedule.eval_k=2",
        "schedule.eval_every=0",
        "checkpoint.every=2",
        "checkpoint.keep_last=3",
    ]


def train_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "megarl.cli", "train", str(ROOT / "examples" / "quickstart.yaml"), *args]


def env() -> dict:
    return dict(os.environ, MEGARL_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def run(args: list[str], timeout: float = 480) -> subprocess.CompletedProcess:
    p = subprocess.run(train_cmd(args), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def metrics(run_dir: Path) -> dict[int, dict]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec
    return out


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qs")
    run_dir = tmp / "ref"
    p = run(overrides(tmp, run_dir, steps=3))
    return tmp, run_dir, p.stdout


def test_short_run_writes_its_outputs(reference_run):
    _tmp, run_dir, stdout = reference_run
    assert (run_dir / "config.resolved.yaml").is_file()
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    m = metrics(run_dir)
    assert sorted(m) == [0, 1, 2, 3]
    assert "eval/pass@1" in m[0] and "eval/pass@1" in m[3]
    for s in (1, 2, 3):
        r = m[s]
        assert 0.0 <= r["reward/mean"] <= 1.0
        assert r["rollout/samples"] == 16 and r["train/optimizer_steps"] == 2
        assert r["train/update_successful"] == 1.0
        # the engine generated with exactly the learner's weights: same logprobs on both sides
        assert r["rollout/logprob_gap_old"] < 1e-4, r["rollout/logprob_gap_old"]
    assert m[1]["rollout/kl_old_ref"] == 0.0  # first step: policy == reference
    # the policy moved away from the reference exactly when an update had a gradient: with every
    # reward 0 (a tiny model early on) the KL term's gradient at policy == reference is 0, unless
    # the two forwards differ in rounding (they may: a different packing of the same tokens)
    moved = any(m[s]["train/grad_norm"] > 0.0 for s in (1, 2))
    assert (m[3]["rollout/kl_old_ref"] != 0.0) == moved, [m[s]["train/grad_norm"] for s in (1, 2)]
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step_000002", "step_000003"]
    assert "step    3/3" in stdout and "held-out pass@1:" in stdout


def test_sigkill_then_resume_reproduces_the_uninterrupted_run(reference_run):
    tmp, ref_dir, _ = reference_run
    run_dir = tmp / "killed"
    # a step hook SIGKILLs the run's process group inside step 3 (after its update, before its
    # checkpoint): a sleep-then-kill lands too late when the steps take a fraction of a second
    args = overrides(tmp, run_dir, steps=3) + ["method.import=tests.trainer.killing_hook:SPEC"]
    proc = subprocess.run(
        train_cmd(args),
        cwd=ROOT,
        env=dict(env(), MEGARL_TEST_KILL_AT_STEP="3"),
        capture_output=True,
        text=True,
        timeout=480,
        start_new_session=True,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (run_dir / "checkpoints" / "step_000002" / "trainer.json").exists()
    assert not (run_dir / "checkpoints" / "step_000003").exists()
    p = run(args)
    assert "resumed from" in p.stdout and "step_000002 (step 2)" in p.stdout
    ref, got = metrics(ref_dir), metrics(run_dir)
    assert sorted(got) == [0, 1, 2, 3]  # nothing lost, nothing repeated
    for s in (1, 2, 3):
        for k in DETERMINISTIC:
            assert got[s][k] == pytest.approx(ref[s][k], rel=1e-5, abs=1e-7), (s, k, got[s][k], ref[s][k])
        assert got[s]["rollout/example"] == ref[s]["rollout/example"]
    assert got[3]["eval/pass@1"] == ref[3]["eval/pass@1"]


def test_truncated_newest_checkpoint_is_skipped_on_resume(reference_run):
    tmp, ref, _ = reference_run
    run_dir = tmp / "truncated"
    shutil.copytree(ref, run_dir)
    step3 = run_dir / "checkpoints" / "step_000003"
    shard = max((step3 / "learner").glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    p = run(overrides(tmp, run_dir, steps=3))
    assert f"skipping incomplete checkpoint {step3} ({shard}: " in p.stdout, p.stdout[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_000002'} (step 2)" in p.stdout
    got, want = metrics(run_dir), metrics(ref)
    assert sorted(got) == [0, 1, 2, 3]
    assert got[3]["reward/mean"] == pytest.approx(want[3]["reward/mean"])
    from megarl.trainer.checkpoint_check import checkpoint_problems

    assert checkpoint_problems(step3) == []  # step 3 was redone and saved whole


def test_resume_never_into_a_used_run_dir(reference_run):
    tmp, ref, _ = reference_run
    run_dir = tmp / "used"
    shutil.copytree(ref, run_dir)
    old_id = (run_dir / "run_id").read_text().strip()
    args = overrides(tmp, run_dir, steps=2) + ["checkpoint.resume=never"]
    p = subprocess.run(train_cmd(args), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert f"logging.run_dir {run_dir} already holds a run (run id {old_id}" in p.stderr + p.stdout
    assert sorted(x.name for x in (run_dir / "checkpoints").iterdir()) == ["step_000002", "step_000003"]

    p = run(args + ["checkpoint.on_existing=archive"])
    archive = tmp / f"used.archived-{old_id}"
    assert f"moved the previous run's outputs from {run_dir} to {archive}" in p.stdout
    assert "warm-up" in p.stdout  # its own initial policy, not the old run's
    assert sorted(x.name for x in (archive / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    new_id = (run_dir / "run_id").read_text().strip()
    assert new_id != old_id
    # the new run's first checkpoint is kept (not pruned against the old run's step 3)
    assert sorted(x.name for x in (run_dir / "checkpoints").iterdir()) == ["step_000002"]
    trainer = json.loads((run_dir / "checkpoints" / "step_000002" / "trainer.json").read_text())
    assert trainer["run_id"] == new_id
    assert sorted(metrics(run_dir)) == [0, 1, 2]
    assert {r["run_id"] for r in metrics(run_dir).values()} == {new_id}
    assert sorted(metrics(archive)) == [0, 1, 2, 3]  # the old run's metrics, whole
