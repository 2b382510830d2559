"""The prepared GPU check (benchmarks/gpu/check.sh): it skips cleanly without a GPU, and its checks
run on the CPU path (fp32, local spec) so the script is known to work before a GPU runs it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu" / "check.sh"


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env
    )


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU driver is present")
def test_skips_cleanly_without_a_gpu():
    res = _run()
    assert res.returncode == 0, res.stderr
    assert "skipped: no NVIDIA GPU" in res.stdout


@pytest.mark.slow
def test_cpu_dry_run_passes_the_parity_checks(tmp_path):
    env = {**os.environ, "MEGARL_GPU_PYTHON": str(ROOT / ".venv" / "bin" / "python")}
    res = _run("--device", "cpu", "--skip", "step,grpo", "--workdir", str(tmp_path), env=env)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    lines = {
        ln.split()[0] + " " + ln.split()[1]: ln for ln in res.stdout.splitlines() if ln.startswith("parity")
    }
    assert set(lines) == {"parity dense", "parity moe"}, res.stdout
    assert all(ln.endswith("OK") for ln in lines.values()), res.stdout
    assert "result             OK" in res.stdout
