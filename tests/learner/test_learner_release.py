"""A dropped learner is freed: megatron DDP's gradient hooks must not keep it alive.

tests/learner/release_case.py builds, trains one step with and drops a tiny learner 8 times in one
process. Every dropped learner must be collected (weak references dead after ``gc.collect``), and
resident memory must stay flat: one leaked learner of this size holds ~56 MiB (model, fp32 gradient
buffer, Adam state), so growth from round 2 to round 8 is held to under 8 MiB in all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROUNDS = 8
RSS_TOLERANCE_MB = 8.0
pytestmark = pytest.mark.slow  # 12-25 s: 8 learners built and trained in a subprocess


def test_dropped_learners_are_freed():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "learner", "release_case.py"), str(ROUNDS)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT, MEGARL_FORCE_CPU="1", MEGARL_NUM_THREADS="1"),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["alive"] == [0] * ROUNDS, res
    rss = res["rss_mb"]
    assert rss[-1] - rss[1] < RSS_TOLERANCE_MB, rss
