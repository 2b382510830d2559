"""A process that starts its one-rank process group (``init_distributed`` outside torchrun) leaves
nothing in its environment for its children: a child that starts its own group (a nested megarl
run, a rollout server, a checkpoint helper) rendezvouses on a port of its own instead of the
parent's, which the parent's store holds."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PARENT = textwrap.dedent(
    """
    import os, subprocess, sys
    from megarl.learner.parallel import init_distributed
    import torch.distributed as dist

    init_distributed()
    assert dist.get_world_size() == 1 and dist.get_rank() == 0
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    leaked = sorted(k for k in names if k in os.environ)
    code = "from megarl.learner.parallel import init_distributed as i; i(timeout_s=20); print('child ok')"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    print("leaked", leaked)
    print("child rc", child.returncode, child.stdout.strip(), child.stderr.strip()[-300:])
    """
)


def test_a_child_of_a_one_rank_process_starts_its_own_group():
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.run(
        [sys.executable, "-c", PARENT], capture_output=True, text=True, timeout=240, env=env, cwd=ROOT
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "leaked []" in p.stdout, p.stdout
    assert "child rc 0 child ok" in p.stdout, p.stdout
