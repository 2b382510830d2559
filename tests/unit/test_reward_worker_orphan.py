"""A contained reward function's worker dies with the trainer, even a SIGKILLed one in the middle of
a call (a hung function: stdin's end alone would not reach it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PARENT = textwrap.dedent(
    """
    import threading, time
    from megarl.rewards.sandbox import ContainedFunction
    f = ContainedFunction("tests.trainer.reward_fns:hangs_on_seven", {"sleep_s": 600}, timeout_s=600)
    threading.Thread(target=f.call, args=("7", "7"), daemon=True).start()
    while f._proc is None:
        time.sleep(0.05)
    time.sleep(2.0)  # the worker has started and is inside the hung call
    print(f._proc.pid, flush=True)
    time.sleep(600)
    """
)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_reward_worker_dies_with_a_sigkilled_trainer_mid_call():
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        worker = int(parent.stdout.readline())
        assert _running(worker)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _running(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = _running(worker)
    finally:
        parent.kill()
        parent.wait(10)
    if alive:
        os.kill(worker, signal.SIGKILL)
    assert not alive, f"reward worker {worker} still alive 10 s after the trainer's SIGKILL"
