"""Launcher failure paths (fast: no real server needed) and the forwarder's own answers."""

from __future__ import annotations

import asyncio
import sys

import httpx
import pytest

from megarl.rollout.auth_proxy import AuthProxy
from megarl.rollout.keys import RolloutKeys
from megarl.rollout.server_process import (
    ServerLaunchError,
    VLLMServer,
    VLLMServerConfig,
    free_port,
    launch_vllm,
)


def test_server_that_exits_gives_its_log_tail(tiny_models, tmp_path):
    # The project venv has no vLLM: the server process exits at once with an import error.
    cfg = VLLMServerConfig(
        model_dir=str(tiny_models["v1"]), python=sys.executable, work_dir=str(tmp_path), startup_timeout_s=60
    )
    with pytest.raises(ServerLaunchError, match="(?s)exited with code 1.*No module named 'vllm'"):
        launch_vllm(cfg)


def test_server_that_never_gets_healthy_times_out_with_log_tail(tiny_models, tmp_path):
    hang = tmp_path / "hanging-python"
    hang.write_text("#!/bin/sh\necho 'still loading the model'\nexec sleep 60\n")
    hang.chmod(0o755)
    cfg = VLLMServerConfig(
        model_dir=str(tiny_models["v1"]), python=str(hang), work_dir=str(tmp_path), startup_timeout_s=2
    )
    server = VLLMServer(cfg, RolloutKeys.generate())
    with pytest.raises(ServerLaunchError, match="(?s)not healthy after 2 s.*still loading the model"):
        server.start()
    assert not server.alive()  # the launcher cleaned up after itself


def test_missing_vllm_python_is_named(tiny_models, tmp_path):
    cfg = VLLMServerConfig(model_dir=str(tiny_models["v1"]), python=str(tmp_path / "nope" / "python"))
    with pytest.raises(ServerLaunchError, match="20-vllm.sh"):
        launch_vllm(cfg)


def test_forwarder_answers_502_when_the_engine_is_gone():
    keys = RolloutKeys.generate()

    async def go():
        proxy = await AuthProxy(f"http://127.0.0.1:{free_port()}", keys).start()
        async with httpx.AsyncClient(base_url=proxy.url) as c:
            ok_key = {"Authorization": f"Bearer {keys.api_key}"}
            r = await c.post("/v1/completions", json={}, headers=ok_key)
            assert r.status_code == 502 and "upstream engine unreachable" in r.json()["error"]["message"]
            assert (await c.post("/v1/completions", json={})).status_code == 401
            assert (await c.get("/docs", headers=ok_key)).status_code == 404
        await proxy.stop()

    asyncio.run(go())


def test_serve_entry_point_refuses_without_keys_and_reports_launch_failure(tiny_models, tmp_path):
    import subprocess

    base = [
        sys.executable,
        "-m",
        "megarl.rollout.serve",
        "--model",
        str(tiny_models["v1"]),
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "--python",
        sys.executable,
        "--work-dir",
        str(tmp_path),
    ]
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("MEGARL_ROLLOUT_")}
    r = subprocess.run(base, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no rollout keys" in r.stderr
    keys = RolloutKeys.generate()
    keyfile = keys.write(tmp_path / "keys.json")
    r = subprocess.run(
        base,
        env={**env, "MEGARL_ROLLOUT_KEY_FILE": str(keyfile)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "No module named 'vllm'" in r.stderr  # the server's log tail, named
    assert keys.api_key not in r.stderr
