"""The SGLang client against every recorded SGLang 0.5.23 exchange (megarl/testing/data), replayed by
the stand-in server in megarl/testing/replay_server.py, including the error cases and the crash.
test_sglang_live.py runs the same behaviours against a real SGLang on CPU (.venv-sglang); the
transcripts keep what a live test cannot stage safely (the out-of-vocabulary crash) and the wire
shape of native ``n > 1`` requests, which the client no longer sends (it sends n>1 as a batch with
one id per sample, so that abort works) but whose answers it still parses."""

from __future__ import annotations

import asyncio
import json

import pytest

from megarl.rollout.keys import RolloutKeys
from megarl.rollout.sglang_client import SGLangEngine
from megarl.rollout.types import AuthError, BadRequestError, EngineDeadError, SamplingParams, WeightsDirError
from megarl.testing.replay_server import SGLANG_ADMIN_ROUTES, ReplayServer
from megarl.testing.tiny_qwen3 import transcript_path
from tests.rollout.conftest import PROMPT
from tests.rollout.hf_reference import hf_greedy

TRANSCRIPT = transcript_path("sglang-0.5.23.jsonl")
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)


async def recorded_samples(eng: SGLangEngine, name: str) -> list:
    """Send a recorded ``/generate`` body as it was and parse the answer (one object or a list)
    with the client."""
    body = await eng.request("POST", "/generate", json_body=recorded(name)["request_json"])
    return [eng._parse_one(o) for o in (body if isinstance(body, list) else [body])]


def recorded(name: str) -> dict:
    for line in TRANSCRIPT.read_text().splitlines():
        rec = json.loads(line)
        if rec["name"] == name:
            return rec
    raise KeyError(name)


def test_every_sglang_transcript_through_the_client(tiny_models, tmp_path):
    v1, v2 = str(tiny_models["v1"]), str(tiny_models["v2"])
    missing = str(tmp_path / "nonexistent")
    keys = RolloutKeys.generate()

    async def go():
        replay = await ReplayServer(
            TRANSCRIPT, {"MODEL_DIR": v1, "MODEL_DIR_V2": v2, "NONEXISTENT_DIR": missing}, keys=keys
        ).start()
        kw = dict(api_key=keys.api_key, admin_key=keys.admin_key, vocab_size=1024, max_model_len=1024)
        plain = SGLangEngine(replay.url, return_logprob=False, **kw)
        out = {}
        # 1-4: health and info
        assert await plain.health()
        assert await plain.health(generate=True)
        assert (await plain.model_info())["weight_version"] == "default"
        assert (await plain.server_info())["context_length"] == 1024
        # 5-7: n=1 -> one object, n=4 -> a list; sampling_seed not honoured by this server
        r = await plain.generate(PROMPT, 1, SamplingParams(max_new_tokens=16, seed=1234))
        assert len(r.samples) == 1 and len(r.samples[0].token_ids) == 16
        assert r.samples[0].finish_reason == "length" and r.samples[0].weight_version == "default"
        a = await recorded_samples(plain, "generate_n4")
        b = await recorded_samples(plain, "generate_n4_same_seed_again")
        assert len(a) == 4 and [s.token_ids for s in a] != [s.token_ids for s in b]
        # 8-9: logprobs of output and prompt tokens
        lp = SGLangEngine(replay.url, logprob_start_len=0, top_logprobs_num=2, **kw)
        for s in await recorded_samples(lp, "generate_logprobs"):
            assert len(s.logprobs) == len(s.token_ids) == 8 and all(x <= 0 for x in s.logprobs)
            assert [t[1] for t in s.meta["input_token_logprobs"]] == PROMPT
        lp5 = SGLangEngine(
            replay.url, logprob_start_len=5, top_logprobs_num=1, return_text_in_logprobs=True, **kw
        )
        r = await lp5.generate(PROMPT, 1, SamplingParams(max_new_tokens=4))
        assert [t[1] for t in r.samples[0].meta["input_token_logprobs"]] == PROMPT[5:]
        assert len(r.samples[0].logprobs) == 4
        # 10-11: stop token included and reported; ignore_eos runs to the limit
        r = await plain.generate(
            PROMPT, 1, SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=(838,))
        )
        s = r.samples[0]
        assert s.token_ids[-1] == 838 and s.finish_reason == "stop" and s.stop_reason == 838
        r = await plain.generate(PROMPT, 1, SamplingParams(max_new_tokens=16, ignore_eos=True))
        assert r.samples[0].finish_reason == "length" and len(r.samples[0].token_ids) == 16
        # 12: a text prompt is not part of the token-in interface: sent raw through the client
        body = await plain.request(
            "POST", "/generate", json_body=recorded("generate_text_prompt")["request_json"]
        )
        out["text_prompt"] = body["output_ids"]
        # 13-18: weight update to v2 and back
        out["greedy_v1"] = (await plain.generate(PROMPT, 1, GREEDY)).samples[0]
        await plain.update_weights(v2, "v2")
        info = await plain.model_info()
        assert info["weight_version"] == "v2" and info["model_path"] == v2
        out["greedy_v2"] = (await plain.generate(PROMPT, 1, GREEDY)).samples[0]
        await plain.update_weights(v1, "v1")
        out["greedy_v1_again"] = (await plain.generate(PROMPT, 1, GREEDY)).samples[0]
        # 19-21: flush and pause/continue while idle
        assert await plain.flush_cache()
        await plain.pause("abort")
        await plain.resume()
        # 22-31 were recorded with plain request ids; the client now sends "<id>#<i>" (SGLang aborts
        # by id prefix), so these bodies go out as recorded and the answers are parsed by the client.
        # 22-25: pause in place with a long request running; flush refused while paused; it resumes
        t = asyncio.ensure_future(recorded_samples(plain, "generate_long_during_pause_in_place"))
        await asyncio.sleep(0.1)
        await plain.pause("in_place")
        assert not await plain.flush_cache()
        await plain.resume()
        (s,) = await t
        assert s.finish_reason == "length" and len(s.token_ids) == 400
        # 26-28: pause in abort mode cuts a running request: HTTP 200, partial output, "abort"
        t = asyncio.ensure_future(recorded_samples(plain, "generate_long_during_pause_abort"))
        await asyncio.sleep(0.1)
        await plain.pause("abort")
        (s,) = await t
        assert s.finish_reason == "abort" and 0 < len(s.token_ids) < 800
        await plain.resume()
        # 29-31: abort one request by id; aborting an unknown id is not an error
        t = asyncio.ensure_future(recorded_samples(plain, "generate_long_aborted"))
        await asyncio.sleep(0.1)
        await plain.request("POST", "/abort_request", json_body={"rid": "long-abort-demo"}, admin=True)
        (s,) = await t
        assert s.finish_reason == "abort" and 0 < len(s.token_ids) < 1000
        await plain.request("POST", "/abort_request", json_body={"rid": "no-such-rid"}, admin=True)
        # 32-34: OpenAI routes, sent raw through the client
        for name in ("v1_completions_n2_logprobs", "v1_chat_completions_n2_logprobs", "v1_models"):
            rec = recorded(name)
            body = await plain.request(rec["method"], rec["path"], json_body=rec["request_json"])
            assert body.get("object") == rec["response_json"]["object"]
        # 35-39: bad requests -> BadRequestError carrying the server's message
        with pytest.raises(BadRequestError, match="Either text, input_ids or input_embeds"):
            await plain.request("POST", "/generate", json_body={"sampling_params": {"max_new_tokens": 4}})
        with pytest.raises(BadRequestError, match="max_new_tokens' must be >= 1"):
            await plain.generate(PROMPT, 1, SamplingParams(max_new_tokens=-1))  # refused before sending
        with pytest.raises(BadRequestError, match="max_new_tokens must be at least 0, got -1"):
            await plain.request(
                "POST",
                "/generate",
                json_body=recorded("bad_generate_negative_max_new_tokens")["request_json"],
            )
        for name in ("bad_generate_invalid_json", "bad_v1_completions_invalid_json"):
            rec = recorded(name)
            with pytest.raises(BadRequestError, match="(?s)HTTP 400: 1 validation error.*JSON decode error"):
                await plain.request("POST", rec["path"], content=rec["request_text"].encode())
        with pytest.raises(BadRequestError, match="HTTP 404: Not Found"):
            await plain.request("GET", "/no_such_endpoint")
        # 40-43: a failed weight update keeps the old weights and the server alive
        with pytest.raises(WeightsDirError, match="does not exist"):
            await plain.update_weights(missing, "v3")  # refused locally, nothing sent
        with pytest.raises(WeightsDirError, match="keeps the old weights.*Failed to get weights iterator"):
            await plain.update_weights(missing, check_dir=False)
        assert plain.dead_reason is None and await plain.health()
        out["greedy_after_bad_update"] = (await plain.generate(PROMPT, 1, GREEDY)).samples[0]
        assert (await plain.model_info())["weight_version"] == "v1"
        # 44-46: an out-of-vocab id is refused client-side; sent anyway, it kills the server
        with pytest.raises(BadRequestError, match="prompt token 1 has id 1024"):
            await plain.generate([5, 1024, 5000], 1, SamplingParams(max_new_tokens=4))
        assert "bad_generate_token_out_of_vocab" in replay.unused()
        with pytest.raises(EngineDeadError, match="RemoteProtocolError|ReadError|connection"):
            await plain.request(
                "POST", "/generate", json_body=recorded("bad_generate_token_out_of_vocab")["request_json"]
            )
        assert not await plain.health()
        fresh = SGLangEngine(replay.url, **kw)
        assert not await fresh.health() and not await fresh.health(generate=True)
        assert fresh.dead_reason and "ConnectError" in fresh.dead_reason
        for e in (plain, lp, lp5, fresh):
            await e.close()
        await replay.stop()
        return replay, out

    replay, out = asyncio.run(go())
    assert replay.unmatched == [] and replay.unused() == []
    # The admin key went to the control routes and only there.
    assert replay.keys_seen
    for path, used in replay.keys_seen:
        assert used == ("admin" if path in SGLANG_ADMIN_ROUTES else "api"), (path, used)
    # The recorded greedy outputs: v1 before == after revert == after the failed update; v2 differs.
    g1, g2 = out["greedy_v1"].token_ids, out["greedy_v2"].token_ids
    assert g1 == out["greedy_v1_again"].token_ids == out["greedy_after_bad_update"].token_ids != g2
    assert out["greedy_v2"].weight_version == "v2" and out["greedy_v1_again"].weight_version == "v1"
    assert out["text_prompt"] == g1[:8]
    # The locally built checkpoints are the recorded ones (same seeds): transformers agrees with
    # SGLang on v2 exactly and on v1 up to the last token (bf16 near-tie, see fixtures README).
    assert hf_greedy(v2, PROMPT, 16) == g2
    assert hf_greedy(v1, PROMPT, 16)[:15] == g1[:15]


def test_wrong_keys_are_refused_by_the_key_policy(tiny_models):
    keys = RolloutKeys.generate()

    async def go():
        replay = await ReplayServer(TRANSCRIPT, {"MODEL_DIR": str(tiny_models["v1"])}, keys=keys).start()
        # The generation key alone cannot reach control routes.
        gen_only = SGLangEngine(replay.url, api_key=keys.api_key, admin_key=keys.api_key, vocab_size=1024)
        with pytest.raises(AuthError, match="401"):
            await gen_only.update_weights(tiny_models["v1"], "x")
        with pytest.raises(AuthError, match="401"):
            await gen_only.pause()
        nokey = SGLangEngine(replay.url, vocab_size=1024)
        assert await nokey.health()  # /health is open, as on SGLang
        with pytest.raises(AuthError, match="401"):
            await nokey.generate(PROMPT, 1, SamplingParams(max_new_tokens=16, seed=1234))
        for e in (gen_only, nokey):
            await e.close()
        await replay.stop()
        return replay

    replay = asyncio.run(go())
    assert replay.used.count(True) == 1  # only /health reached the recorded exchanges


def test_n_samples_go_out_as_a_batch_with_one_id_per_sample():
    """SGLang gives the samples of a native n>1 request random ids of their own, which no abort can
    name; the client sends n copies of the prompt with ids ``<rid>#<i>`` (seed + i each) instead, and
    the "#" keeps one request's ids from being a prefix of another's (SGLang aborts by prefix)."""
    from megarl.rollout.types import GenerateRequest

    eng = SGLangEngine("http://127.0.0.1:1", vocab_size=1024)
    sp = SamplingParams(max_new_tokens=4, seed=7)
    one = eng.generate_body(GenerateRequest(PROMPT, 1, sp, request_id="r"))
    assert one["rid"] == "r#0" and one["input_ids"] == PROMPT and one["sampling_params"]["sampling_seed"] == 7
    three = eng.generate_body(GenerateRequest(PROMPT, 3, sp, request_id="r"))
    assert three["rid"] == ["r#0", "r#1", "r#2"] and three["input_ids"] == [PROMPT] * 3
    assert [p["sampling_seed"] for p in three["sampling_params"]] == [7, 8, 9]
    assert all("n" not in p for p in three["sampling_params"])
    asyncio.run(eng.close())
