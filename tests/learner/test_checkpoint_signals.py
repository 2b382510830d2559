"""Learner checkpoints survive the stop signals Slurm sends to every process of a step.

megatron's checkpoint writer runs helper processes (forked bucket writers) that do not share the
trainer's handlers; before megarl blocked the stop signals around
the save, a SIGUSR1 to the process group killed them and every later save failed (EOFError).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def test_saves_succeed_while_the_process_group_gets_sigusr1(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "signal_save_case.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        start_new_session=True,
        env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    res = json.loads(lines[-1][7:])
    assert res["saves"] == ["ok", "ok", "ok"], res
    assert res["signals_received"] > 0  # the trainer's own handler still sees the signals
