"""The embedded (in-process transformers) engine: the vLLM behaviour tests that apply to it."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from megarl.rollout.embedded import EmbeddedEngine, teacher_forced_logprobs
from megarl.rollout.environments import GuessingGame, episodes_to_batch, run_episode
from megarl.rollout.types import BadRequestError, EngineDeadError, SamplingParams, WeightsDirError
from tests.rollout.conftest import PROMPT
from tests.rollout.decoding import until_decoding
from tests.rollout.hf_reference import hf_greedy

GREEDY = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_models):
    return EmbeddedEngine.from_pretrained(str(tiny_models["v1"]))


def run(coro):
    return asyncio.run(coro)


def test_n_samples_logprobs_equal_recomputation_and_seed_reproduces(engine):
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True, seed=5)
    a = run(engine.generate(PROMPT, n=4, sampling=sp))
    b = run(engine.generate(PROMPT, n=4, sampling=sp))
    c = run(engine.generate(PROMPT, n=4, sampling=SamplingParams(max_new_tokens=12, ignore_eos=True, seed=6)))
    assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
    assert [s.token_ids for s in a.samples] != [s.token_ids for s in c.samples]
    assert len({tuple(s.token_ids) for s in a.samples}) > 1
    for s in a.samples:
        assert len(s.token_ids) == len(s.logprobs) == 12 and s.finish_reason == "length"
        ref = teacher_forced_logprobs(engine.model, PROMPT, s.token_ids)
        # Same fp32 model, KV-cached decode vs one full forward: agreement to rounding.
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=1e-4)


def test_greedy_equals_transformers_across_weight_update_and_revert(tiny_models):
    eng = EmbeddedEngine.from_pretrained(str(tiny_models["v1"]))
    ref1 = hf_greedy(str(tiny_models["v1"]), PROMPT, 16)
    ref2 = hf_greedy(str(tiny_models["v2"]), PROMPT, 16)

    async def go():
        out = [(await eng.generate(PROMPT, sampling=GREEDY)).samples[0]]
        await eng.update_weights(tiny_models["v2"], version="2")
        out.append((await eng.generate(PROMPT, sampling=GREEDY)).samples[0])
        await eng.update_weights(tiny_models["v1"], version="3")
        out.append((await eng.generate(PROMPT, sampling=GREEDY)).samples[0])
        return out

    s1, s2, s3 = run(go())
    assert s1.token_ids == ref1 and s2.token_ids == ref2 and s3.token_ids == ref1
    assert (s1.weight_version, s2.weight_version, s3.weight_version) == ("0", "2", "3")


def test_in_memory_weight_update(tiny_models):
    from safetensors.torch import load_file

    eng = EmbeddedEngine.from_pretrained(str(tiny_models["v1"]))
    state = load_file(str(tiny_models["v2"] / "model.safetensors"))
    run(eng.update_weights_from_tensors(state, version="7"))
    s = run(eng.generate(PROMPT, sampling=GREEDY)).samples[0]
    assert s.token_ids == hf_greedy(str(tiny_models["v2"]), PROMPT, 16) and s.weight_version == "7"


def test_stop_token_and_stop_string(engine, tiny_models):
    greedy = hf_greedy(str(tiny_models["v1"]), PROMPT, 8)
    s = run(
        engine.generate(
            PROMPT, sampling=SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=(greedy[2],))
        )
    ).samples[0]
    assert s.token_ids == greedy[:3] and s.finish_reason == "stop" and s.stop_reason == greedy[2]
    text = engine.tokenizer.decode(greedy[:2])
    s = run(
        engine.generate(
            PROMPT, sampling=SamplingParams(temperature=0, max_new_tokens=8, stop_strings=(text[-3:],))
        )
    ).samples[0]
    assert s.token_ids == greedy[:2] and s.finish_reason == "stop"


def test_bad_requests(engine, tmp_path):
    with pytest.raises(BadRequestError, match="prompt token 2 has id 5000"):
        run(engine.generate([5, 6, 5000]))
    with pytest.raises(BadRequestError, match="prompt token 0 has id -1"):
        run(engine.generate([-1]))
    with pytest.raises(BadRequestError, match="exceeds max_model_len=2048"):
        run(engine.generate(PROMPT, sampling=SamplingParams(max_new_tokens=2040)))
    with pytest.raises(BadRequestError, match="'top_p' must be in"):
        run(engine.generate(PROMPT, sampling=SamplingParams(top_p=0)))
    with pytest.raises(BadRequestError, match="the prompt has no token"):
        run(engine.generate([]))
    with pytest.raises(WeightsDirError, match="missing"):
        run(engine.update_weights(tmp_path))


def test_abort_returns_partial_output_and_pause_holds_requests(tiny_models):
    eng = EmbeddedEngine.from_pretrained(str(tiny_models["v1"]))

    async def go():
        long = asyncio.ensure_future(
            eng.generate(
                PROMPT, sampling=SamplingParams(max_new_tokens=2000 - 20, ignore_eos=True), request_id="long"
            )
        )
        await until_decoding(eng, "long")  # a token or more, far from its 1980
        assert await eng.abort("long") == 1
        aborted = (await long).samples[0]
        await eng.pause()
        held = asyncio.ensure_future(eng.generate(PROMPT, sampling=SamplingParams(max_new_tokens=2)))
        await asyncio.sleep(0.2)
        assert not held.done() and eng.outstanding == 1
        await eng.resume()
        return aborted, await held

    aborted, held = run(go())
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 1980
    assert len(aborted.logprobs) == len(aborted.token_ids)
    assert len(held.samples[0].token_ids) == 2


def test_concurrency_bound_is_backpressure(tiny_models):
    eng = EmbeddedEngine.from_pretrained(str(tiny_models["v1"]), max_concurrency=2)

    async def go():
        peak = 0
        tasks = [
            asyncio.ensure_future(eng.generate(PROMPT, sampling=SamplingParams(max_new_tokens=8)))
            for _ in range(6)
        ]
        while not all(t.done() for t in tasks):
            peak = max(peak, len(eng._inflight))
            assert eng.outstanding <= 6
            await asyncio.sleep(0.001)
        return peak, [t.result() for t in tasks]

    peak, results = run(go())
    assert peak == 2 and len(results) == 6


def test_shutdown_fails_in_flight_and_later_requests(tiny_models):
    eng = EmbeddedEngine.from_pretrained(str(tiny_models["v1"]))

    async def go():
        t = asyncio.ensure_future(
            eng.generate(PROMPT, sampling=SamplingParams(max_new_tokens=1500, ignore_eos=True))
        )
        await until_decoding(eng)
        eng.shutdown("test kill")
        with pytest.raises(EngineDeadError, match="test kill"):
            await t
        with pytest.raises(EngineDeadError, match="engine is down"):
            await eng.generate(PROMPT)
        assert not await eng.health()

    run(go())


def test_multi_turn_guessing_game_masks_observations(engine):
    async def go():
        env = GuessingGame(engine.tokenizer, lo=1, hi=1, max_turns=3)  # secret is 1
        return await run_episode(
            engine, env, SamplingParams(max_new_tokens=6, seed=1, ignore_eos=True), seed=0, max_turns=3
        )

    ep = run(go())
    batch = episodes_to_batch([ep], group_ids=[0], policy_versions=[0])
    assert batch.turn_spans[0][0] == (0, ep.prompt_len, "prompt")
    gen = sum(e - s for s, e, r in ep.turn_spans if r == "assistant")
    assert batch.loss_mask.sum().item() == gen > 0
    obs = [(s, e) for s, e, r in ep.turn_spans if r == "observation"]
    assert obs and all(batch.loss_mask[s:e].sum() == 0 for s, e in obs)
    assert all(math.isfinite(x) for x in batch.rollout_logprobs.tolist())
