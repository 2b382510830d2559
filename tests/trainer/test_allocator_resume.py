"""An allocator's state survives SIGKILL: a shrunk run of each allocation example, killed after its
first checkpoint and started again, resumes from that checkpoint and reproduces the uninterrupted
run step for step (the rewards, the loss, every budget/ and allocator metric), and both runs end
with the same allocator state in their last checkpoint."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch

from tests.trainer.test_quickstart_run import ROOT, env, metrics, overrides

pytestmark = pytest.mark.slow

EXAMPLES = {"sara": "examples/methods/sara.yaml", "pair": "examples/methods/pair.yaml"}
COMPARED = ("reward/", "budget/", "alloc/", "sara/", "pair/", "train/loss", "train/grad_norm")


def _cmd(example: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "megarl.cli", "train", str(ROOT / example), *args]


def _run(example: str, args: list[str]) -> str:
    p = subprocess.run(_cmd(example, args), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=480)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def _method_state(run_dir, step: int) -> dict:
    path = run_dir / "checkpoints" / f"step_{step:06d}" / "method.pt"
    return torch.load(path, weights_only=False)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_sigkill_then_resume_keeps_the_allocator_state(name, tmp_path):
    example = EXAMPLES[name]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    # one request at a time in the embedded engine: batched decoding rounds differently with the
    # batch's composition, which differs between a run and its resume (docs/rollout.md)
    exact = ["rollout.embedded_batch_rows=1"]
    # a step hook SIGKILLs the run's process group inside step 3 (tests/trainer/killing_hook.py);
    # the uninterrupted run has it too (inactive), so both save the same method state
    exact += [f"method.import=tests.trainer.killing_hook:{name.upper()}"]
    _run(example, overrides(tmp_path, ref_dir, steps=3) + exact)
    args = overrides(tmp_path, run_dir, steps=3) + exact
    proc = subprocess.run(
        _cmd(example, args),
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
    assert "step_000002 (step 2)" in _run(example, args)
    ref, got = metrics(ref_dir), metrics(run_dir)
    assert sorted(got) == [0, 1, 2, 3]
    for s in (1, 2, 3):
        keys = [k for k in ref[s] if k.startswith(COMPARED)]
        assert any(k.startswith(f"{name}/") or k.startswith("alloc/") for k in keys), sorted(ref[s])
        for k in keys:
            assert got[s][k] == pytest.approx(ref[s][k], rel=1e-5, abs=1e-7), (s, k, got[s][k], ref[s][k])
    assert _equal(_method_state(ref_dir, 3), _method_state(run_dir, 3))
