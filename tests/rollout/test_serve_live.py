"""``python -m megarl.rollout.serve`` for real (vLLM CPU), as a Slurm rollout command runs it: keys
from a 0600 key file, the trainer's engine (``connect_servers``) reaching generation and control
routes with the same file, and every process of the server gone within 10 s of serve's SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.rollout.keys import KEY_FILE_ENV, RolloutKeys
from megarl.rollout.server_process import free_port
from megarl.rollout.types import SamplingParams
from tests.rollout.conftest import PROMPT
from tests.vllm_venv import require_vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def descendants(pid: int) -> dict[int, str]:
    """Every process below ``pid``, with its start time (so a reused pid is not mistaken for it)."""
    stats = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stats[int(name)] = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                pass
    out, todo = {}, [pid]
    while todo:
        parent = todo.pop()
        for p, f in stats.items():
            if int(f[1]) == parent and p not in out:
                out[p] = f[19]
                todo.append(p)
    return out


def still_running(procs: dict[int, str]) -> list[int]:
    left = []
    for pid, start in procs.items():
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if f[19] == start and f[0] != "Z":
            left.append(pid)
    return left


def test_serve_with_a_key_file_then_sigkill(tiny_models, tmp_path, monkeypatch):
    from megarl.trainer.config_sections import RolloutConfig
    from megarl.trainer.servers import connect_servers

    python = require_vllm_python()
    key_file = RolloutKeys.generate().write(tmp_path / "rollout-keys.json")
    for name in ("MEGARL_ROLLOUT_API_KEY", "MEGARL_ROLLOUT_ADMIN_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(KEY_FILE_ENV, str(key_file))  # read by serve (inherited) and by the trainer
    cmd = [
        sys.executable,
        "-m",
        "megarl.rollout.serve",
        "--model",
        str(tiny_models["v1"]),
        "--host",
        "127.0.0.1",
    ]
    cmd += ["--port", str(free_port()), "--python", python, "--dtype", "float32", "--max-model-len", "256"]
    cmd += ["--work-dir", str(tmp_path / "work"), "--startup-timeout", "600"]
    serve = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    procs: dict[int, str] = {}
    try:
        line = serve.stdout.readline()
        assert line.startswith("READY "), f"serve exited with {serve.poll()}: {line!r}"
        url = line.split()[1]

        async def trainer_side():
            engine = connect_servers(RolloutConfig(engine="vllm", urls=[url]))
            try:
                res = await engine.generate(
                    PROMPT, sampling=SamplingParams(max_new_tokens=4, ignore_eos=True)
                )
                await engine.pause()
                await engine.resume()
                return res
            finally:
                await engine.close()

        res = asyncio.run(trainer_side())
        assert len(res.samples[0].token_ids) == 4
        procs = descendants(serve.pid)
        assert len(procs) >= 3, procs  # vLLM (and its engine core), the forwarder, the watchdog
        serve.send_signal(signal.SIGKILL)
        serve.wait(10)
        deadline = time.monotonic() + 10
        while still_running(procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = still_running(procs)
    finally:
        serve.kill()
        serve.wait(10)
        for pid in still_running(procs):
            os.kill(pid, signal.SIGKILL)
    assert left == [], f"still alive 10 s after serve's SIGKILL: {left}"
