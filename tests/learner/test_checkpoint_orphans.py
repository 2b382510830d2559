"""The helper processes of a learner checkpoint die with the trainer, even a SIGKILLed one.

megatron's writer forks bucket writers (and would spawn a ``multiprocessing`` Manager server for its
results queue, which megarl replaces with an in-process queue); megarl blocks SIGTERM/SIGUSR1 in
them (test_checkpoint_signals), so only SIGKILL could stop them, and nothing stopped them when the
trainer was SIGKILLed. With the in-process queue no helper outlives a save
(test_step_overhead.py checks that in-process); this test SIGKILLs a trainer after a save and
checks that whatever it left is gone within 10 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def start_time(pid: int) -> str | None:
    """Start time (ticks since boot) of a running pid; None when gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


@pytest.mark.slow  # 19 s idle, 28 s at load 25 (a megatron learner in a subprocess)
def test_checkpoint_helpers_die_with_a_sigkilled_trainer(tmp_path):
    trainer = subprocess.Popen(
        [sys.executable, str(HERE / "orphan_save_case.py"), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
    )
    try:
        line = ""
        for line in trainer.stdout:
            if line.startswith("HELPERS "):
                break
        assert line.startswith("HELPERS "), f"the trainer exited with {trainer.wait()} before saving"
        # processes alive after the save: none with megarl's in-process results queue (the bucket
        # writers are joined); any there is must die with the SIGKILLed trainer
        helpers = {pid: start_time(pid) for pid in json.loads(line[8:])}
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(10)
        deadline = time.monotonic() + 10
        left = list(helpers)
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = [p for p, st in helpers.items() if start_time(p) == st]
    finally:
        trainer.kill()
        trainer.wait(10)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"checkpoint helpers still alive 10 s after the trainer's SIGKILL: {left}"
