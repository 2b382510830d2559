"""The SGLang server venv for the live SGLang tests: its python, or a skip (a failure under CI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megarl.rollout.server_process import default_sglang_python


def require_sglang_python() -> str:
    """The SGLang venv's python (``.venv-sglang``, or ``$MEGARL_SGLANG_PYTHON``). Skips the test when
    it is missing, loudly; fails it under CI (``make setup`` installs the venv there) unless
    ``MEGARL_SKIP_SGLANG_SETUP=1`` said to go without, and fails it with ``MEGARL_REQUIRE_SGLANG=1``."""
    python = default_sglang_python()
    if not Path(python).exists():
        msg = (
            f"SGLANG LIVE TESTS NOT RUN: no SGLang python at {python}. Make it with "
            "`make setup-sglang` (bash tests/setup/40-sglang.sh) or set MEGARL_SGLANG_PYTHON"
        )
        if os.environ.get("MEGARL_REQUIRE_SGLANG") == "1":
            pytest.fail(msg + " (MEGARL_REQUIRE_SGLANG=1)")
        ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
        if ci and os.environ.get("MEGARL_SKIP_SGLANG_SETUP") != "1":
            pytest.fail(msg + " (CI: make setup installs it; MEGARL_SKIP_SGLANG_SETUP=1 skips instead)")
        pytest.skip(msg)
    return python
