"""Per-job random keys for the rollout servers: a generation key and a separate admin key.

Keys travel through the environment or a file readable by the job's user only, never on a
command line (``/proc/PID/cmdline`` is world-readable on a shared node).
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

API_KEY_ENV = "MEGARL_ROLLOUT_API_KEY"
ADMIN_KEY_ENV = "MEGARL_ROLLOUT_ADMIN_KEY"
KEY_FILE_ENV = "MEGARL_ROLLOUT_KEY_FILE"


@dataclass(frozen=True)
class RolloutKeys:
    """``api_key`` guards generation, ``admin_key`` guards control routes (reload, pause, ...)."""

    api_key: str
    admin_key: str

    @staticmethod
    def generate() -> RolloutKeys:
        """Two fresh 256-bit random keys."""
        return RolloutKeys(secrets.token_urlsafe(32), secrets.token_urlsafe(32))

    def env(self) -> dict[str, str]:
        """The environment variables that carry the keys to a child process."""
        return {API_KEY_ENV: self.api_key, ADMIN_KEY_ENV: self.admin_key}

    def write(self, path: str | os.PathLike) -> Path:
        """Write the keys to ``path`` with mode 0600 (created fresh; an existing file is replaced)."""
        p = Path(path)
        tmp = p.with_name(p.name + f".tmp{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"api_key": self.api_key, "admin_key": self.admin_key}, f)
        os.replace(tmp, p)
        return p

    @staticmethod
    def read(path: str | os.PathLike) -> RolloutKeys:
        """Read a key file; refuse one that other users can read."""
        p = Path(path)
        mode = p.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise PermissionError(
                f"{p}: key file must be readable by its owner only (mode {oct(mode & 0o777)})"
            )
        data = json.loads(p.read_text())
        try:
            return RolloutKeys(str(data["api_key"]), str(data["admin_key"]))
        except KeyError as e:
            raise ValueError(f"{p}: key file lacks the field {e}") from e

    @staticmethod
    def from_env(environ: dict | None = None) -> RolloutKeys:
        """Keys from ``MEGARL_ROLLOUT_API_KEY``/``..._ADMIN_KEY`` or the file named by
        ``MEGARL_ROLLOUT_KEY_FILE``."""
        env = os.environ if environ is None else environ
        if env.get(KEY_FILE_ENV):
            return RolloutKeys.read(env[KEY_FILE_ENV])
        if env.get(API_KEY_ENV) and env.get(ADMIN_KEY_ENV):
            return RolloutKeys(env[API_KEY_ENV], env[ADMIN_KEY_ENV])
        raise KeyError(f"no rollout keys: set {KEY_FILE_ENV} or both {API_KEY_ENV} and {ADMIN_KEY_ENV}")
