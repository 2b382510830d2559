"""Child processes that die with the process that started them, even when it is SIGKILLed.

Four mechanisms, for four kinds of children:

- ``preexec_die_with_parent(sig)``: a ``Popen(preexec_fn=...)`` that sets Linux's
  ``PR_SET_PDEATHSIG`` in the child before it execs: the kernel sends ``sig`` to the child when the
  *thread* that started it exits, so start such children from a thread that lives as long as the
  process (the main thread).
- ``forks_die_with_parent()``: a block inside which every ``os.fork`` child (multiprocessing's fork
  start method included) gets ``PR_SET_PDEATHSIG`` = SIGKILL; for short-lived helpers forked and
  joined by the same thread (megatron's checkpoint bucket writers).
- ``exit_when_parent_dies(parent_pid)``: a daemon thread in the child itself that exits the process
  once its parent is gone; for long-lived Python helpers whose starting thread may end first
  (the reward sandbox's worker; a ``multiprocessing`` Manager server, via its ``initializer``).
- ``shared_watchdog().watch(pgid)``: a separate process that kills whole process groups (SIGTERM,
  then SIGKILL) once this process is gone; for servers that fork workers of their own or run under
  ``srun``, where a signal to one process is not enough. It learns of the death from a pipe: the
  kernel closes the write end when this process dies, however it dies.

Run as ``python -m megarl.launch.lifeline [--grace S]`` with the pipe's read end on stdin (what
``GroupWatchdog`` does): lines ``+PGID`` / ``-PGID`` add or drop a group; at end of input it kills
the groups still listed.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

PR_SET_PDEATHSIG = 1
_prctl: Callable[..., int] | None = None


def _resolve_prctl() -> Callable[..., int]:
    """libc's prctl, looked up in the parent: a forked child must not take the loader's locks."""
    global _prctl
    if _prctl is None:
        if not sys.platform.startswith("linux"):
            raise OSError("PR_SET_PDEATHSIG needs Linux")
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    return _prctl


def set_parent_death_signal(sig: int, parent_pid: int | None = None) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits. With ``parent_pid``:
    if the parent is already gone (this process was re-parented before the call), send it now."""
    prctl = _resolve_prctl()
    if prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def preexec_die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the started child get ``sig`` when this process dies."""
    _resolve_prctl()
    parent = os.getpid()
    return lambda: set_parent_death_signal(sig, parent)


_fork_guard_depth = 0
_fork_hook_registered = False
_forker_pid = 0  # the pid of the process that is forking (set just before every fork)


def _before_fork() -> None:
    global _forker_pid
    _forker_pid = os.getpid()


def _after_fork_in_child() -> None:
    # the parent's pid as it was at fork time: os.getppid() here would already name the reaper if
    # the parent died before this line ran, and that death would go unnoticed
    if _fork_guard_depth > 0:
        set_parent_death_signal(signal.SIGKILL, _forker_pid)


@contextmanager
def forks_die_with_parent() -> Iterator[None]:
    """Every process forked inside this block gets SIGKILL when its parent thread exits (the
    process dies or the forking thread ends)."""
    global _fork_guard_depth, _fork_hook_registered
    _resolve_prctl()
    if not _fork_hook_registered:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _fork_hook_registered = True
    _fork_guard_depth += 1
    try:
        yield
    finally:
        _fork_guard_depth -= 1


def exit_when_parent_dies(parent_pid: int, interval_s: float = 0.2) -> threading.Thread:
    """Start a daemon thread that ends this process (``os._exit``: no handler or blocked signal
    can stop it) once ``parent_pid`` is no longer its parent. Usable as a ``multiprocessing``
    ``initializer``."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(1)

    t = threading.Thread(target=watch, name="megarl-exit-with-parent", daemon=True)
    t.start()
    return t


class GroupWatchdog:
    """A process that kills the watched process groups (SIGTERM, SIGKILL after ``grace_s``) when
    this process dies or ``close()`` is called. It runs here, beside the processes it watches (an
    ``srun`` client stops its remote step on SIGTERM)."""

    def __init__(self, grace_s: float = 5.0):
        read_fd, self._write_fd = os.pipe()  # both non-inheritable: no exec'd child holds the write end
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "megarl.launch.lifeline", "--grace", str(grace_s)],
                stdin=read_fd,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # a signal to our process group must not take it with us
            )
        finally:
            os.close(read_fd)
        self._lock = threading.Lock()

    def _send(self, line: str) -> None:
        with self._lock:
            if self._write_fd >= 0:
                os.write(self._write_fd, line.encode())

    def watch(self, pgid: int) -> None:
        """Kill process group ``pgid`` when this process dies."""
        self._send(f"+{pgid}\n")

    def forget(self, pgid: int) -> None:
        """``pgid`` ended normally: do not touch it (its id may be reused)."""
        self._send(f"-{pgid}\n")

    def close(self, wait_s: float = 15.0) -> None:
        """Close the pipe: the watchdog kills the groups still watched and exits."""
        with self._lock:
            if self._write_fd >= 0:
                os.close(self._write_fd)
                self._write_fd = -1
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def _close_in_fork_child(self) -> None:
        # A forked child must not keep the pipe open: the watchdog would wait for it too.
        if self._write_fd >= 0:
            os.close(self._write_fd)
            self._write_fd = -1


_shared: GroupWatchdog | None = None
_shared_lock = threading.Lock()


def shared_watchdog() -> GroupWatchdog:
    """This process's watchdog, started on first use."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared.proc.poll() is not None:
            _shared = GroupWatchdog()
            os.register_at_fork(after_in_child=_shared._close_in_fork_child)
        return _shared


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # the group id was reused by another user's processes
        return False


def leader_handle(pgid: int) -> int | None:
    """A pidfd of the group's leader (the process whose pid is ``pgid``): it names that process
    and no later one with a reused id. None where pidfds are not available or the leader is gone."""
    try:
        return os.pidfd_open(pgid)
    except (AttributeError, OSError):
        return None


def same_group(pgid: int, leader: int | None) -> bool:
    """Whether process group ``pgid`` still exists and is the one whose leader ``leader`` (a pidfd,
    see ``leader_handle``) named. Linux does not hand out a pid that is still some process group's
    id, so a live group whose leader has died is the same group (workers that outlived it) unless
    a process now holds the pid ``pgid`` itself: then the id was reused by a new session leader
    after the whole old group had gone, and that group is someone else's."""
    if not _group_alive(pgid):
        return False
    if leader is None:
        return True  # no identity to check (no pidfd): the group as it is now
    try:
        signal.pidfd_send_signal(leader, 0)
        return True  # the original leader still runs (or is an unreaped zombie)
    except ProcessLookupError:
        pass
    try:
        os.kill(pgid, 0)
    except ProcessLookupError:
        return True  # no process has that pid: the live group is the old leader's orphans
    except PermissionError:
        return False
    return False


def kill_group(pgid: int, grace_s: float, term: bool = True) -> None:
    """SIGTERM process group ``pgid`` (unless ``term`` is False), then SIGKILL whatever is left
    after ``grace_s``."""
    if not _group_alive(pgid):
        return
    if term:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            return
    deadline = time.monotonic() + grace_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main(argv: list[str] | None = None) -> int:
    """The watchdog process: follow ``+PGID``/``-PGID`` lines on stdin; at EOF kill what is listed."""
    p = argparse.ArgumentParser(prog="python -m megarl.launch.lifeline", description=__doc__.split("\n")[0])
    p.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL")
    args = p.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # step-wide signals: this process's job comes after them
    groups: dict[int, int | None] = {}  # pgid -> pidfd of its leader, taken when it was listed
    for line in sys.stdin.buffer:
        text = line.decode(errors="replace").strip()
        if text[:1] in "+-" and text[1:].isdigit():
            pgid = int(text[1:])
            old = groups.pop(pgid, None)
            if old is not None:
                os.close(old)
            if text[0] == "+":
                groups[pgid] = leader_handle(pgid)
    # a group whose id was reused after it ended (a listed server that died on its own) is left alone
    mine = [pgid for pgid, leader in groups.items() if same_group(pgid, leader)]
    for pgid in mine:  # all groups get SIGTERM first, then share one grace period
        try:
            os.killpg(pgid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    for pgid in mine:
        kill_group(pgid, args.grace, term=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
