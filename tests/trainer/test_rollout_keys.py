"""The trainer's keys for rollout servers it did not start (``rollout.urls``): from a 0600 key file
(``rollout.key_file`` or ``MEGARL_ROLLOUT_KEY_FILE``) or the environment, never from config values;
the generation key on generation routes and the admin key on control routes, for vLLM and SGLang.
Against the SGLang stand-in (measured key policy) here; against a real vLLM behind megarl's
forwarder in tests/rollout/test_vllm.py."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from megarl.rollout.keys import ADMIN_KEY_ENV, API_KEY_ENV, KEY_FILE_ENV, RolloutKeys
from megarl.rollout.types import AuthError
from megarl.testing.replay_server import ReplayServer
from megarl.testing.tiny_qwen3 import transcript_path
from megarl.trainer.config import ConfigError
from megarl.trainer.config_sections import RolloutConfig
from megarl.trainer.servers import connect_servers

TRANSCRIPT = transcript_path("sglang-0.5.23.jsonl")
KEY_ENVS = (KEY_FILE_ENV, API_KEY_ENV, ADMIN_KEY_ENV)


@pytest.fixture(autouse=True)
def no_key_env(monkeypatch):
    for name in KEY_ENVS:
        monkeypatch.delenv(name, raising=False)


def write_key_file(path, keys: RolloutKeys, mode: int = 0o600):
    keys.write(path)
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o700 | 0o010])
def test_key_file_others_can_touch_is_refused_naming_it(tmp_path, mode):
    path = write_key_file(tmp_path / "keys.json", RolloutKeys.generate(), mode)
    with pytest.raises(ConfigError, match=rf"{path}: key file must be readable by its owner only.*chmod 600"):
        connect_servers(RolloutConfig(engine="vllm", urls=["http://127.0.0.1:1"], key_file=str(path)))


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "rollout key file not found"),
        ("not json", "rollout key file is not JSON"),
        ('["a", "b"]', "must hold"),
        ('{"api_key": "a"}', "lacks the field 'admin_key'"),
        ('{"api_key": "", "admin_key": "b"}', "'api_key' must be a non-empty string"),
    ],
)
def test_bad_key_file_is_named_with_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "keys.json"
    if content is not None:
        path.write_text(content)
        path.chmod(0o600)
    with pytest.raises(ConfigError, match=f"{path}: .*{message}"):
        connect_servers(RolloutConfig(engine="sglang", urls=["http://127.0.0.1:1"], key_file=str(path)))


def test_key_sources_and_their_order(tmp_path):
    a, b, c = RolloutKeys.generate(), RolloutKeys.generate(), RolloutKeys.generate()
    fa = write_key_file(tmp_path / "a.json", a)
    fb = write_key_file(tmp_path / "b.json", b)
    pair = {API_KEY_ENV: c.api_key, ADMIN_KEY_ENV: c.admin_key}
    assert RolloutKeys.for_client(None, {}) is None
    assert RolloutKeys.for_client(None, pair) == c
    assert RolloutKeys.for_client(None, {**pair, KEY_FILE_ENV: str(fb)}) == b
    assert RolloutKeys.for_client(str(fa), {**pair, KEY_FILE_ENV: str(fb)}) == a  # the config's path wins
    with pytest.raises(KeyError, match=f"{API_KEY_ENV} is set but {ADMIN_KEY_ENV} is not"):
        RolloutKeys.for_client(None, {API_KEY_ENV: "x"})
    os.chmod(fb, 0o644)  # an unsafe file named in the environment is refused too
    with pytest.raises(PermissionError, match=str(fb)):
        RolloutKeys.for_client(None, {KEY_FILE_ENV: str(fb)})


def test_keys_are_not_config_values():
    from megarl.trainer.config_loading import load_config

    with pytest.raises(ConfigError, match="api_key"):
        load_config(Path(__file__).parents[2] / "examples" / "quickstart.yaml", ["rollout.api_key=secret"])


@pytest.mark.parametrize("source", ["config", "env_file", "env_pair"])
def test_trainer_engine_presents_the_keys_to_sglang(tmp_path, monkeypatch, source):
    keys = RolloutKeys.generate()

    async def start():
        return await ReplayServer(
            TRANSCRIPT, {"MODEL_DIR": str(tmp_path)}, keys=keys, only=["flush_cache"]
        ).start()

    loop = asyncio.new_event_loop()
    replay = loop.run_until_complete(start())
    try:
        rollout = RolloutConfig(engine="sglang", urls=[replay.url])
        path = write_key_file(tmp_path / "keys.json", keys)
        if source == "config":
            rollout.key_file = str(path)
        elif source == "env_file":
            monkeypatch.setenv(KEY_FILE_ENV, str(path))
        else:
            monkeypatch.setenv(API_KEY_ENV, keys.api_key)
            monkeypatch.setenv(ADMIN_KEY_ENV, keys.admin_key)

        async def control():
            engine = connect_servers(rollout)
            try:
                assert await engine.flush_cache()  # a control route: needs the admin key
            finally:
                await engine.close()

        loop.run_until_complete(control())
        assert ("/flush_cache", "admin") in replay.keys_seen
    finally:
        loop.run_until_complete(replay.stop())
        loop.close()


def test_trainer_engine_without_keys_gets_a_401_that_says_how_to_set_them(tmp_path):
    keys = RolloutKeys.generate()

    async def go():
        replay = await ReplayServer(
            TRANSCRIPT, {"MODEL_DIR": str(tmp_path)}, keys=keys, only=["flush_cache"]
        ).start()
        engine = connect_servers(RolloutConfig(engine="sglang", urls=[replay.url]))
        try:
            with pytest.raises(AuthError, match=f"401.*no key was sent.*rollout.key_file.*{KEY_FILE_ENV}"):
                await engine.flush_cache()
        finally:
            await engine.close()
            await replay.stop()

    asyncio.run(go())


def test_key_file_json_written_by_rolloutkeys_is_what_the_trainer_reads(tmp_path):
    keys = RolloutKeys.generate()
    path = keys.write(tmp_path / "k.json")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert json.loads(path.read_text()) == {"api_key": keys.api_key, "admin_key": keys.admin_key}
    assert RolloutKeys.for_client(str(path), {}) == keys


def test_generated_keys_never_start_with_a_dash():
    """A key is handed to SGLang as a command-line value (``--admin-api-key KEY``, from its config
    file); argparse takes a value starting with '-' for an option and the server exits ("expected
    one argument"). token_urlsafe starts with '-' once in 64 keys."""
    keys = [RolloutKeys.generate() for _ in range(1000)]
    assert not [k for ks in keys for k in (ks.api_key, ks.admin_key) if k.startswith("-")]
    assert len({k.api_key for k in keys}) == 1000 and all(len(k.api_key) >= 43 for k in keys)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_trainer_engine_refuses_out_of_vocabulary_ids_before_sending(engine):
    """The trainer's engine over servers at rollout.urls checks prompt ids against the model's
    vocabulary: one id outside it killed a live SGLang server. Nothing listens at the URL, so a
    request that got as far as the network would fail with a connection error instead."""
    from megarl.rollout.types import BadRequestError

    eng = connect_servers(
        RolloutConfig(engine=engine, urls=["http://127.0.0.1:1"]), log=lambda *_: None, vocab_size=1024
    )
    assert eng.vocab_size == 1024

    async def go():
        try:
            await eng.generate([5, 1024, 7])
        finally:
            await eng.close()

    with pytest.raises(BadRequestError, match="1024"):
        asyncio.run(go())
