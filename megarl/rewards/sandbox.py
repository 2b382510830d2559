"""Run a user reward function ("module:function") in a worker process, with a timeout per call.

A function that raises, returns something that is not a finite number, or runs past the timeout
does not stop the run: the call returns ``(None, "error: ...")`` / ``(None, "timeout")`` and the
caller applies the fallback reward. A hung worker is killed and a fresh one is started on the next
call. The worker is a plain subprocess (``python -m megarl.rewards.sandbox module:function``)
speaking JSON lines over its stdin/stdout: no fork of the multi-threaded trainer, and no re-import
of the trainer's main module as multiprocessing's spawn would do.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import select
import subprocess
import sys
import traceback
from typing import Callable, Optional


def resolve_function(path: str) -> Callable:
    """``"package.module:function"`` -> the callable (raises ValueError naming the path)."""
    mod_name, _, fn_name = path.partition(":")
    if not mod_name or not fn_name:
        raise ValueError(f"reward function {path!r} must look like 'package.module:function'")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - any import failure is reported with the path
        raise ValueError(f"reward function {path!r}: cannot import {mod_name!r}: {e!r}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward function {path!r}: {mod_name!r} has no callable {fn_name!r}")
    return fn


def _worker_main(path: str, kwargs_json: str) -> None:
    """Worker loop: one JSON request per stdin line, one JSON answer per line on the original stdout."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the user's function prints goes to stderr, not into the protocol
    sys.stdout = sys.stderr
    fn = resolve_function(path)
    kwargs = json.loads(kwargs_json)
    out.write('"ready"\n')
    for line in sys.stdin:
        req = json.loads(line)
        try:
            v = float(fn(req["response"], req["answer"], **kwargs))
            ans = {"value": v} if math.isfinite(v) else {"error": f"returned non-finite {v}"}
        except BaseException as e:  # noqa: BLE001 - the function's failure is data for the caller
            ans = {"error": traceback.format_exception_only(type(e), e)[-1].strip()}
        out.write(json.dumps(ans) + "\n")


class ContainedFunction:
    """``call(response, answer) -> (value or None, failure or None)`` in a worker process."""

    def __init__(self, path: str, kwargs: Optional[dict] = None, timeout_s: float = 5.0):
        resolve_function(path)  # fail at start with a clear message, not in the worker
        self.path, self.kwargs, self.timeout_s = path, dict(kwargs or {}), timeout_s
        self._proc: Optional[subprocess.Popen] = None

    def _start(self) -> None:
        env = dict(os.environ)
        paths = [os.getcwd()] + [p for p in sys.path if p]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "megarl.rewards.sandbox", self.path, json.dumps(self.kwargs)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1)
        # start-up (interpreter + the user's imports) is not part of a call's time budget
        if self._readline(max(60.0, self.timeout_s)) != '"ready"':
            self._kill()
            raise RuntimeError(f"reward worker for {self.path!r} did not start")

    def _readline(self, timeout: float) -> Optional[str]:
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self._proc.stdout.readline()
        return line.strip() if line else None

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=10)
            for f in (self._proc.stdin, self._proc.stdout):
                if f is not None:
                    f.close()
        self._proc = None

    def call(self, response: str, answer: str) -> tuple[Optional[float], Optional[str]]:
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
        except (BrokenPipeError, OSError) as e:
            self._kill()
            return None, f"error: worker died ({e!r})"
        if line is None:
            dead = self._proc.poll() is not None
            self._kill()
            return None, "error: worker died" if dead else "timeout"
        ans = json.loads(line)
        if "error" in ans:
            return None, f"error: {ans['error']}"
        return float(ans["value"]), None

    def close(self) -> None:
        """Stop the worker."""
        self._kill()


if __name__ == "__main__":
    _worker_main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "{}")
