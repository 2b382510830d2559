"""The run directory end to end, on the shrunk quickstart run of test_quickstart_run.py:

- the newest checkpoint's shard file cut short: the resume skips it (naming the file), continues
  from the one before and redoes the step;
- ``checkpoint.resume: never`` into that used directory is refused with a message naming it, and
  with ``checkpoint.on_existing: archive`` the old run moves aside and a new run starts from its
  own warm-up (its first checkpoint kept, its metrics its own).
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.trainer.test_quickstart_run import ROOT, env, metrics, overrides, run, train_cmd

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rundir")
    run_dir = tmp / "ref"
    run(overrides(tmp, run_dir, steps=3))
    return tmp, run_dir


def test_truncated_newest_checkpoint_is_skipped_on_resume(finished_run):
    tmp, ref = finished_run
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


def test_resume_never_into_a_used_run_dir(finished_run):
    tmp, ref = finished_run
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
