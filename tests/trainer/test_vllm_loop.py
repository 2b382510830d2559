"""The quickstart with a real vLLM server in the loop (examples/quickstart-vllm.yaml): the run starts
the server itself from the vLLM venv, the Megatron learner runs at TP=2 (torchrun, 2 gloo ranks),
and after every step the TP-sharded weights go to the server as a HF checkpoint it reloads.

What a 3-step run can show reliably is that the weights really sync and training proceeds, not
that the reward improves (that takes tens of steps): every step's rollouts must have been generated
by exactly the weights the learner holds when it recomputes their logprobs (fp32 server vs fp32
learner: mean |gap| measured 1.2e-7), while the policy moves away from the reference by far more
than that gap. A server stuck on the initial weights would show a gap of mean |old - ref| >=
|mean(old - ref)| = |rollout/kl_old_ref|, so the gap staying 10x below |kl_old_ref| rules it out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.vllm_venv import require_vllm_python

ROOT = Path(__file__).parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_quickstart_vllm_tp2_syncs_weights_and_trains(tmp_path):
    require_vllm_python()
    run_dir = tmp_path / "run"
    args = [f"logging.run_dir={run_dir}", f"data.train={tmp_path / 'train.jsonl'}",
            f"data.eval={tmp_path / 'eval.jsonl'}", "data.generate.num_eval=16", "schedule.steps=3",
            "schedule.prompts_per_step=8", "schedule.eval_samples=16", "schedule.eval_k=2", "checkpoint.every=10",
            "logging.plot=false"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megarl.cli", "train", str(ROOT / "examples" / "quickstart-vllm.yaml"), *args]
    env = dict(os.environ, MEGARL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    wall = time.monotonic() - t0
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    print(f"\nquickstart-vllm, 3 steps at TP=2: {wall:.0f} s wall")
    assert "vLLM server healthy after" in p.stdout
    m = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(m) == [0, 1, 2, 3]
    for s in (1, 2, 3):
        r = m[s]
        print(f"step {s}: logprob gap {r['rollout/logprob_gap_old']:.2e}  reward {r['reward/mean']:.3f}  "
              f"kl_old_ref {r['rollout/kl_old_ref']:.2e}")
        assert r["rollout/samples"] == 64 and r["train/update_successful"] == 1.0
        assert r["rollout/logprob_gap_old"] < 1e-4, (s, r["rollout/logprob_gap_old"])
        assert 0.0 <= r["reward/mean"] <= 1.0
    assert m[1]["rollout/kl_old_ref"] == pytest.approx(0.0, abs=1e-5)  # step 1: policy == reference
    assert 0.0 < m[1]["reward/mean"] < 1.0  # the warm-up makes some samples right: the policy gets a gradient
    assert abs(m[3]["rollout/kl_old_ref"]) > 10 * m[3]["rollout/logprob_gap_old"]  # moved, and the server with it
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == [f"v{v:06d}" for v in range(4)]
    assert "eval/pass@1" in m[3]
