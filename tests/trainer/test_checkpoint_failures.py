"""A checkpoint save that runs out of disk, and a resume whose newest checkpoint is cut short.

tests/trainer/checkpoint_case.py does the work on a real tiny learner (megatron dist_checkpointing,
one CPU process); each test runs one mode and checks its JSON report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
pytestmark = pytest.mark.slow  # ~20 s each: megatron imported and a learner built in a subprocess


def case(mode: str, run_dir: Path) -> dict:
    p = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "trainer" / "checkpoint_case.py"), mode, str(run_dir)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), MEGARL_FORCE_CPU="1", MEGARL_NUM_THREADS="1"),
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def check_disk_full(res: dict, run_dir: Path) -> None:
    root = run_dir / "checkpoints"
    assert res["error_type"] == "CheckpointSaveError", res
    msg = res["message"]
    assert msg.startswith(f"no space left on {root} ("), msg
    assert f"while saving checkpoint step {res['step']}; the last complete checkpoint is step 1 " in msg
    assert str(root / "step_000001") in msg
    # the partial save is gone, the complete checkpoint stays the newest
    assert res["dirs"] == ["step_000001"] and res["latest"] == "step_000001", res


def test_enospc_during_save_names_the_path_and_the_last_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    res = case("enospc", run_dir)
    assert res["step"] == 2
    check_disk_full(res, run_dir)
    assert "[Errno 28] No space left on device" in res["message"]  # the write error is quoted


def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0:
        return False
    path.mkdir(parents=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode == 0


def test_a_full_small_tmpfs_during_save(tmp_path):
    """The real thing: a 4 MiB tmpfs holds one ~2.4 MiB checkpoint of the tiny learner, not two."""
    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "4m"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        res = case("fill", mnt / "run")
        assert res["step"] == 2
        check_disk_full(res, mnt / "run")
    finally:
        subprocess.run(["umount", str(mnt)])


def test_resume_skips_a_truncated_newest_checkpoint_and_names_it(tmp_path):
    run_dir = tmp_path / "run"
    res = case("truncate", run_dir)
    step2 = run_dir / "checkpoints" / "step_000002"
    assert res["pick"] == str(run_dir / "checkpoints" / "step_000001") and res["loaded_step"] == 1
    (skip,) = set(res["logs"])
    assert skip.startswith(f"megarl train: skipping incomplete checkpoint {step2} ({res['cut']}: "), skip
    assert "the index needs at least" in skip and skip.endswith("it is left on disk")
    assert res["dirs"] == ["step_000001", "step_000002"]  # nothing deleted
    # loading the truncated one anyway: an error naming the checkpoint, not a bare EOFError
    assert res["direct_load"].startswith(f"CheckpointError: {step2}: loading the learner state failed"), res
    # a shard file gone and a cut common.pt are named too
    damaged = run_dir / "damaged"
    assert res["damaged"] == [
        f"{damaged / '__0_0.distcp'}: missing",
        f"{damaged / 'common.pt'}: unreadable (File is not a zip file)",
    ]
    # a checkpoint of another run id is refused
    assert "was written by run run-a" in res["foreign"] and "holds run run-b" in res["foreign"]
