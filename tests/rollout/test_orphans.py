"""Launched servers die with the process that launched them, even when it is SIGKILLed (atexit
does not run then): a server in a session of its own would otherwise live on, holding its port
and (on a GPU node) its memory. Here with a stand-in server; with the real vLLM under
``megarl.rollout.serve`` in test_serve_live.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def stub_python(tmp_path: Path) -> str:
    """A "python" that runs the stub server whatever module it is asked for."""
    exe = tmp_path / "stub-python"
    exe.write_text(f'#!/bin/sh\nexec {sys.executable} {HERE / "stub_server.py"} "$@"\n')
    exe.chmod(0o755)
    return str(exe)


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat), None when gone or a
    zombie: (pid, start time) names one process even if the pid is reused."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def alive(procs: dict[int, str]) -> list[int]:
    """The pids in ``procs`` still running as the same process."""
    return [pid for pid, st in procs.items() if start_time(pid) == st]


def launch_and_kill_parent(model_dir: str, python: str, work_dir: Path, timeout_s: float) -> list[int]:
    """Run orphan_parent.py, SIGKILL it once its server is up; returns the server processes still
    alive 10 s later."""
    parent = subprocess.Popen(
        [sys.executable, str(HERE / "orphan_parent.py"), model_dir, python, str(work_dir), str(timeout_s)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        line = ""
        for line in parent.stdout:
            if line.startswith("PIDS "):
                break
        assert line.startswith("PIDS "), f"parent exited with {parent.wait()} before its server started"
        procs = {pid: start_time(pid) for pid in json.loads(line[5:])}
        assert len(procs) >= 2, procs  # the server and its worker (and the forwarder)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while alive(procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = alive(procs)
    finally:
        parent.kill()
        parent.wait(10)
    for pid in left:  # leave nothing behind for the next test
        os.kill(pid, signal.SIGKILL)
    return left


def test_launched_server_dies_with_a_sigkilled_parent(tiny_models, tmp_path):
    left = launch_and_kill_parent(str(tiny_models["v1"]), stub_python(tmp_path), tmp_path / "work", 60)
    assert left == [], f"still alive 10 s after the parent's SIGKILL: {left}"
