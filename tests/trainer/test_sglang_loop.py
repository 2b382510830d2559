"""The quickstart with a real SGLang server in the loop: ``rollout.engine: sglang`` with
``rollout.launch: true`` and ``server_device: cpu`` makes the run start SGLang 0.5.23's CPU engine
itself (the venv of tests/setup/40-sglang.sh) on its warmed-up policy, and after every step the
learner's weights go to the server in memory (``weight_sync: auto`` = memory for a launched
server; SGLang's ``/update_weights_from_distributed`` over gloo, its checksums compared).

Every step's rollouts must come from exactly the weights the learner holds when it recomputes
their logprobs (fp32 server vs fp32 learner), while the policy moves away from the reference by
far more than that gap: a server stuck on the initial weights would show a gap of at least
|rollout/kl_old_ref|. Skips without the SGLang venv (as tests/rollout/test_sglang_live.py does).

Opt-in (``MEGARL_SGLANG_LOOP=1`` runs it; skipped otherwise, so not part of CI): a second SGLang
server start plus a 4-step run, 143 s measured at load average 2.8-8.2, where the suite has no room
left; tests/rollout/test_sglang_live.py covers the client, the in-memory sync and its checksums in
CI, and tests/trainer/test_vllm_loop.py the same loop with a launched vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.sglang_venv import require_sglang_python

ROOT = Path(__file__).parents[2]
STEPS = 4
pytestmark = pytest.mark.slow


def test_quickstart_launches_sglang_and_syncs_weights_in_memory(tmp_path):
    if os.environ.get("MEGARL_SGLANG_LOOP") != "1":
        pytest.skip("opt-in for time (about 2 minutes, a second SGLang server): MEGARL_SGLANG_LOOP=1 runs it")
    python = require_sglang_python()
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "megarl.cli",
        "train",
        str(ROOT / "examples" / "quickstart.yaml"),
        f"logging.run_dir={run_dir}",
        f"data.train={tmp_path / 'train.jsonl'}",
        f"data.eval={tmp_path / 'eval.jsonl'}",
        "rollout.engine=sglang",
        "rollout.launch=true",
        "rollout.server_device=cpu",
        f"rollout.server_python={python}",
        "rollout.server_startup_timeout_s=900",
        f"schedule.steps={STEPS}",
        "schedule.prompts_per_step=8",
        "schedule.eval_every=0",
        "checkpoint.every=100",
        "logging.plot=false",
    ]
    env = dict(os.environ, MEGARL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500, check=False)
    wall = time.monotonic() - t0
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    print(f"\nquickstart with a launched SGLang CPU server, {STEPS} steps: {wall:.0f} s wall")
    assert "SGLang server healthy after" in p.stdout
    assert not (run_dir / "weights").exists()  # in memory: no checkpoint per step
    m = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(m) == list(range(STEPS + 1))
    for s in range(1, STEPS + 1):
        r = m[s]
        gap, kl = r["rollout/logprob_gap_old"], r["rollout/kl_old_ref"]
        print(f"step {s}: logprob gap {gap:.2e}  kl_old_ref {kl:.2e}")
        assert r["rollout/samples"] == 64 and r["train/update_successful"] == 1.0
        assert r["rollout/logprob_gap_old"] < 1e-4, (s, r["rollout/logprob_gap_old"])
    assert m[1]["rollout/kl_old_ref"] == pytest.approx(0.0, abs=1e-5)  # step 1: policy == reference
    assert abs(m[STEPS]["rollout/kl_old_ref"]) > 10 * m[STEPS]["rollout/logprob_gap_old"]
