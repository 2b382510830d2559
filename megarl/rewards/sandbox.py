"""Run a user reward function ("module:function") in a worker process, with a timeout per call.

A function that raises, returns something that is not a number (a string such as ``"0.75"``
included) or not finite in float32 (NaN, inf, 1e39), or runs past the timeout does not stop the
run: the call returns ``(None, "error: ...")`` / ``(None, "timeout")`` and the caller applies the
fallback reward. A worker process that exits or is killed during a call gives ``(None, "worker
died: ...")``. A hung worker is killed, and after a timeout or a death a fresh worker is started on
the next call. The worker is a plain subprocess (``python -m megarl.rewards.sandbox module:function``)
speaking JSON lines over its stdin/stdout: no fork of the multi-threaded trainer, and no re-import
of the trainer's main module as multiprocessing's spawn would do.
"""

from __future__ import annotations

import importlib
import json
import math
import numbers
import os
import select
import subprocess
import sys
import traceback
from collections.abc import Callable

TIMEOUT = "timeout"
WORKER_DIED = "worker died"
# rewards are stored as float32: a float64 value beyond this is inf there
FLOAT32_MAX = 3.4028234663852886e38


def check_reward_value(v: object) -> tuple[float | None, str | None]:
    """``(float(v), None)`` for a real number that is finite in float32, else ``(None, why)``.

    Booleans count as 0/1; strings, None, tensors and other objects are refused (a string that
    looks like a number is still a wrong return type).
    """
    if not isinstance(v, numbers.Real):
        return None, f"error: returned {type(v).__name__} {v!r:.60}, not a number"
    f = float(v)
    if not math.isfinite(f):
        return None, f"error: returned non-finite {f}"
    if abs(f) > FLOAT32_MAX:
        return None, f"error: returned {f:g}, beyond the float32 range of rewards (non-finite there)"
    return f, None


def failure_kind(why: str) -> str:
    """``"timeout"``, ``"worker_death"`` or ``"error"`` for the failure string of a call."""
    if why == TIMEOUT:
        return "timeout"
    if why.startswith(WORKER_DIED):
        return "worker_death"
    return "error"


class _WorkerDied(Exception):
    """The worker's stdout reached its end: the process exited or was killed."""


def resolve_function(path: str) -> Callable:
    """``"package.module:function"`` -> the callable (raises ValueError naming the path)."""
    mod_name, _, fn_name = path.partition(":")
    if not mod_name or not fn_name:
        raise ValueError(f"reward function {path!r} must look like 'package.module:function'")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # any import failure is reported with the path
        raise ValueError(f"reward function {path!r}: cannot import {mod_name!r}: {e!r}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward function {path!r}: {mod_name!r} has no callable {fn_name!r}")
    return fn


def _worker_main(path: str, kwargs_json: str) -> None:
    """Worker loop: one JSON request per stdin line, one JSON answer per line on the original stdout."""
    from megarl.launch.lifeline import exit_when_parent_dies

    exit_when_parent_dies(os.getppid())  # a hung call must not outlive a SIGKILLed trainer
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the user's function prints goes to stderr, not into the protocol
    sys.stdout = sys.stderr
    fn = resolve_function(path)
    kwargs = json.loads(kwargs_json)
    out.write('"ready"\n')
    for line in sys.stdin:
        req = json.loads(line)
        try:
            v, why = check_reward_value(fn(req["response"], req["answer"], **kwargs))
            ans = {"value": v} if why is None else {"error": why.removeprefix("error: ")}
        except BaseException as e:  # the function's failure is data for the caller
            ans = {"error": traceback.format_exception_only(type(e), e)[-1].strip()}
        out.write(json.dumps(ans) + "\n")


class ContainedFunction:
    """``call(response, answer) -> (value or None, failure or None)`` in a worker process."""

    def __init__(self, path: str, kwargs: dict | None = None, timeout_s: float = 5.0):
        resolve_function(path)  # fail at start with a clear message, not in the worker
        self.path, self.kwargs, self.timeout_s = path, dict(kwargs or {}), timeout_s
        self._proc: subprocess.Popen | None = None

    def _start(self) -> None:
        env = dict(os.environ)
        paths = [os.getcwd()] + [p for p in sys.path if p]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "megarl.rewards.sandbox", self.path, json.dumps(self.kwargs)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            bufsize=1,
        )
        # start-up (interpreter + the user's imports) is not part of a call's time budget
        try:
            ok = self._readline(max(60.0, self.timeout_s)) == '"ready"'
        except _WorkerDied:
            ok = False
        if not ok:
            self._kill()
            raise RuntimeError(f"reward worker for {self.path!r} did not start")

    def _readline(self, timeout: float) -> str | None:
        """The worker's next line; None after ``timeout`` s; ``_WorkerDied`` at the end of its output."""
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self._proc.stdout.readline()
        if not line:
            raise _WorkerDied
        return line.strip()

    def _death(self) -> str:
        """Reap the dead worker; ``"worker died (exit code N / killed by signal N)"``."""
        try:
            code = self._proc.wait(timeout=10)
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        except subprocess.TimeoutExpired:
            how = "output closed, process still running"
        self._kill()
        return f"{WORKER_DIED} ({how}); a fresh worker starts on the next call"

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=10)
            for f in (self._proc.stdin, self._proc.stdout):
                if f is not None:
                    f.close()
        self._proc = None

    def call(self, response: str, answer: str) -> tuple[float | None, str | None]:
        """One call; never raises for the function's own failures."""
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            try:
                self._start()
            except (RuntimeError, OSError) as e:
                return None, f"error: {e}"
        try:
            self._proc.stdin.write(json.dumps({"response": response, "answer": answer}) + "\n")
            self._proc.stdin.flush()
            line = self._readline(self.timeout_s)
        except (_WorkerDied, BrokenPipeError, OSError):
            return None, self._death()
        if line is None:
            if self._proc.poll() is not None:
                return None, self._death()
            self._kill()
            return None, TIMEOUT
        ans = json.loads(line)
        if "error" in ans:
            return None, f"error: {ans['error']}"
        return check_reward_value(ans.get("value"))

    def close(self) -> None:
        """Stop the worker."""
        self._kill()


if __name__ == "__main__":
    _worker_main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "{}")
