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


def _key() -> str:
    """A URL-safe 256-bit random key that does not start with '-'."""
    while True:
        k = secrets.token_urlsafe(32)
        if not k.startswith("-"):
            return k


@dataclass(frozen=True)
class RolloutKeys:
    """``api_key`` guards generation, ``admin_key`` guards control routes (reload, pause, ...)."""

    api_key: str
    admin_key: str

    @staticmethod
    def generate() -> RolloutKeys:
        """Two fresh 256-bit random keys, neither starting with '-' (SGLang reads its keys as
        command-line values, and argparse takes a value starting with '-' for an option)."""
        return RolloutKeys(_key(), _key())

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
        """Read a key file (JSON ``{"api_key": ..., "admin_key": ...}``); refuse one that other users
        can read, write or run (``chmod 600 FILE``). Errors name the file and what is wrong."""
        p = Path(path)
        try:
            st = p.stat()
        except FileNotFoundError:
            raise FileNotFoundError(f"{p}: rollout key file not found") from None
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{p}: rollout key file is not a regular file")
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise PermissionError(
                f"{p}: key file must be readable by its owner only (mode {oct(st.st_mode & 0o777)}; "
                f"run chmod 600 {p})"
            )
        try:
            data = json.loads(p.read_text())
        except ValueError as e:
            raise ValueError(f"{p}: rollout key file is not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f'{p}: rollout key file must hold {{"api_key": ..., "admin_key": ...}}')
        for field_name in ("api_key", "admin_key"):
            if field_name not in data:
                raise ValueError(f"{p}: key file lacks the field '{field_name}'")
            if not isinstance(data[field_name], str) or not data[field_name]:
                raise ValueError(f"{p}: key file field '{field_name}' must be a non-empty string")
        return RolloutKeys(data["api_key"], data["admin_key"])

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

    @staticmethod
    def for_client(
        key_file: str | os.PathLike | None = None, environ: dict | None = None
    ) -> RolloutKeys | None:
        """The keys a client presents to servers started by someone else, or None (no keys: servers
        without authentication). Sources, first found wins: ``key_file``, the file named by
        ``MEGARL_ROLLOUT_KEY_FILE``, the pair ``MEGARL_ROLLOUT_API_KEY`` + ``..._ADMIN_KEY``. A key
        file that others can read, or only one of the two variables, is an error."""
        env = os.environ if environ is None else environ
        if key_file:
            return RolloutKeys.read(key_file)
        api, admin = env.get(API_KEY_ENV), env.get(ADMIN_KEY_ENV)
        if env.get(KEY_FILE_ENV) or (api and admin):
            return RolloutKeys.from_env(env)
        if api or admin:
            have, missing = (API_KEY_ENV, ADMIN_KEY_ENV) if api else (ADMIN_KEY_ENV, API_KEY_ENV)
            raise KeyError(f"{have} is set but {missing} is not: the rollout keys come as a pair")
        return None
