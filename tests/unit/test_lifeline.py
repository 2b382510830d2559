"""megarl.launch.lifeline: children that die with a SIGKILLed parent, and only those."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The parent forks one sleeping child with multiprocessing's fork start method (as megatron's
# checkpoint writer does), inside forks_die_with_parent() or not, prints its pid and waits.
FORK_PARENT = textwrap.dedent(
    """
    import contextlib, multiprocessing, sys, time
    from megarl.launch.lifeline import forks_die_with_parent
    guard = forks_die_with_parent() if sys.argv[1] == "guarded" else contextlib.nullcontext()
    with guard:
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
        child.start()
    print(child.pid, flush=True)
    time.sleep(600)
    """
)

# The parent starts a process group of two sleeping processes, registers it with the watchdog
# (or registers and then forgets it), prints the pids and waits.
WATCHDOG_PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    from megarl.launch.lifeline import shared_watchdog
    leader = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 600 & wait"], start_new_session=True)
    time.sleep(0.5)
    shared_watchdog().watch(leader.pid)
    if sys.argv[1] == "forget":
        shared_watchdog().forget(leader.pid)
    print(leader.pid, flush=True)
    time.sleep(600)
    """
)


def _run_and_kill(code: str, arg: str, window_s: float) -> list[int]:
    """Run ``code``, read the pid it prints (a process group for the watchdog case), SIGKILL it and
    return the processes of that pid's group still alive ``window_s`` later."""
    parent = subprocess.Popen(
        [sys.executable, "-c", code, arg],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        pid = int(parent.stdout.readline())
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + window_s
        while _members(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _members(pid)
    finally:
        parent.kill()
        parent.wait(10)
    for p in left:
        os.kill(p, signal.SIGKILL)
    return left


def _members(pid: int) -> list[int]:
    """Running (not zombie) processes that are ``pid`` or in process group ``pid``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and (int(name) == pid or int(fields[2]) == pid):
            out.append(int(name))
    return out


@pytest.mark.parametrize("mode, dies", [("guarded", True), ("unguarded", False)])
def test_forked_child_dies_with_parent_only_inside_the_guard(mode, dies):
    left = _run_and_kill(FORK_PARENT, mode, 10 if dies else 3)
    assert (left == []) == dies, left


@pytest.mark.parametrize("mode, dies", [("watch", True), ("forget", False)])
def test_watchdog_kills_a_watched_group_that_ignores_sigterm_and_spares_a_forgotten_one(mode, dies):
    left = _run_and_kill(WATCHDOG_PARENT, mode, 10 if dies else 3)
    assert (left == []) == dies, left


def _session(cmd: str) -> subprocess.Popen:
    return subprocess.Popen(["sh", "-c", cmd], start_new_session=True)


def test_a_group_id_taken_by_a_new_session_leader_is_not_the_watched_group():
    """The watchdog checks a listed group's identity before killing it: an id whose old group has
    gone and that now names a new session leader (pid reuse) is spared; the original leader, and
    workers that outlive their leader, are still its group."""
    from megarl.launch.lifeline import leader_handle, same_group

    old = _session("exit 0")
    old_leader = leader_handle(old.pid)
    if old_leader is None:
        pytest.skip("no pidfd on this kernel: the watchdog cannot tell a reused group id apart")
    old.wait()
    new = _session("sleep 600")
    try:
        time.sleep(0.2)
        # the old leader's identity against a live group whose leader is another process: this is
        # what a reused id looks like (the new leader holds the pid equal to the group id)
        assert not same_group(new.pid, old_leader)
        assert same_group(new.pid, leader_handle(new.pid))
        assert not same_group(old.pid, old_leader)  # gone
    finally:
        os.killpg(new.pid, signal.SIGKILL)
        new.wait()
    # a leader that exits leaving a worker behind: still its group
    orphaning = _session("sleep 600 & echo $!")
    leader = leader_handle(orphaning.pid)
    orphaning.wait()
    try:
        assert same_group(orphaning.pid, leader)
    finally:
        os.killpg(orphaning.pid, signal.SIGKILL)
