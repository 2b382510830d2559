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


def test_sglang_launch_files_that_can_hold_keys_are_private(tiny_models, tmp_path):
    """SGLang prints both API keys into its log at start-up: the launcher's work directory is 0700,
    the log and the keys file 0600 (a log left 0644 by an earlier server too), and the command line
    it logs names the keys file, not the keys. The project venv has no SGLang, so the server exits
    at once; the files are made before that."""
    import stat

    from megarl.rollout.server_process import SGLangServer, SGLangServerConfig

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_bytes((tiny_models["v1"] / "config.json").read_bytes())
    keys = RolloutKeys.generate()
    server = SGLangServer(SGLangServerConfig(model_dir=str(model), python=sys.executable), keys)
    assert server.work_dir.parent == tmp_path and stat.S_IMODE(server.work_dir.stat().st_mode) == 0o700
    server.log_path.write_text("from an earlier server\n")
    server.log_path.chmod(0o644)
    with pytest.raises(ServerLaunchError, match="(?s)exited with code 1.*No module named 'sglang'"):
        server.start()
    assert stat.S_IMODE(server.log_path.stat().st_mode) == 0o600
    assert stat.S_IMODE((server.work_dir / "sglang-keys.yaml").stat().st_mode) == 0o600
    log = server.log_path.read_text()
    assert "--config" in log and keys.api_key not in log and keys.admin_key not in log
