"""The vLLM server venv for tests marked ``vllm``: its python, or a skip (a failure under CI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megarl.rollout.server_process import default_vllm_python


def require_vllm_python() -> str:
    """The vLLM venv's python; skips the test when it is missing, fails it when CI is set."""
    python = default_vllm_python()
    if not Path(python).exists():
        msg = f"vLLM venv missing ({python}); run `bash tests/setup/20-vllm.sh`"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(msg + " (CI: tests marked vllm must not be skipped)")
        pytest.skip(msg)
    return python
