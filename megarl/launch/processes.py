"""Child processes of a launcher: started in their own process group, watched, signalled and torn down."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass


@dataclass
class Child:
    """One process the launcher started; ``label`` names it in logs (e.g. 'learner rank 3 (local 1) on
    node2')."""

    label: str
    proc: subprocess.Popen

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int, group: bool = True) -> None:
        """Send ``sig`` to the child's whole process group (servers often fork workers), or to the child only.

        group=False is for "checkpoint and stop" requests: a learner's helper processes (e.g. megatron's
        checkpoint writer workers) must not get them, they die of SIGUSR1 mid-write.
        """
        try:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        except ProcessLookupError:
            pass


def spawn(label: str, cmd: list[str], env: dict[str, str]) -> Child:
    """Start ``cmd`` in a new session with ``env``; stdout/stderr go to the launcher's (Slurm's output
    file)."""
    return Child(label, subprocess.Popen(cmd, env=env, start_new_session=True))


def wait_all(children: list[Child], timeout_s: float) -> bool:
    """Wait until every child exited or ``timeout_s`` passed; True when all exited."""
    deadline = time.monotonic() + timeout_s
    while any(c.returncode is None for c in children):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def terminate_all(children: list[Child], grace_s: float = 10.0) -> None:
    """SIGTERM every live child's process group, then SIGKILL what is left after ``grace_s``."""
    for c in children:
        if c.returncode is None:
            c.signal(signal.SIGTERM)
    if not wait_all(children, grace_s):
        for c in children:
            if c.returncode is None:
                c.signal(signal.SIGKILL)
        wait_all(children, 5.0)
    for c in children:  # the process groups may hold grandchildren that ignored SIGTERM
        c.signal(signal.SIGKILL)
