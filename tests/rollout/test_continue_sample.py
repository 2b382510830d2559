"""Continuing a sample from its prefix (``RolloutEngine.continue_sample`` /
``continue_from_prefix``) on the real embedded engine: the prefix's tokens and logprobs come back
unchanged, the continuation is sampled given the prefix (its logprobs are the teacher-forced ones of
the whole sequence), and bad prefixes are refused."""

import asyncio
import dataclasses

import pytest
import torch

from megarl.rollout.embedded import EmbeddedEngine, hf_model_from_config, teacher_forced_logprobs
from megarl.rollout.engine import continue_from_prefix, join_continuation
from megarl.rollout.types import BadRequestError, Sample, SamplingParams
from megarl.testing.tiny_qwen3 import TINY_QWEN3_HF

HF = dict(TINY_QWEN3_HF, vocab_size=40, eos_token_id=1)
PROMPT = [5, 9, 12, 7]


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    return EmbeddedEngine(hf_model_from_config(HF), eos_token_ids=[1])


def test_prefix_tokens_and_logprobs_are_unchanged_and_the_tail_is_conditional(engine):
    sp = SamplingParams(temperature=1.0, max_new_tokens=3, ignore_eos=True, seed=11)

    async def go():
        prefixes = (await engine.generate(PROMPT, n=3, sampling=sp)).samples
        tails = [dataclasses.replace(sp, max_new_tokens=5, seed=12 + i) for i in range(3)]
        return prefixes, [await engine.continue_sample(PROMPT, s, t) for s, t in zip(prefixes, tails)]

    prefixes, full = asyncio.run(go())
    for pre, s in zip(prefixes, full):
        assert pre.finish_reason == "length" and len(pre.token_ids) == 3
        assert s.token_ids[:3] == pre.token_ids and s.logprobs[:3] == pre.logprobs  # bit for bit
        assert len(s.token_ids) == 8 and len(s.logprobs) == 8 and s.finish_reason == "length"
        ref = teacher_forced_logprobs(engine.model, PROMPT, s.token_ids)
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=1e-5)
        assert s.weight_version == "0" and s.meta["mixed"] is False
    assert len({tuple(s.token_ids[3:]) for s in full}) > 1


def test_a_continuation_across_a_weight_version_keeps_the_oldest_and_is_mixed(engine):
    pre = Sample(token_ids=[3, 4], logprobs=[-1.0, -2.0], finish_reason="length", weight_version="0")
    engine.weight_version = "1"
    try:
        s = asyncio.run(
            continue_from_prefix(
                engine, PROMPT, pre, SamplingParams(max_new_tokens=2, ignore_eos=True, seed=1)
            )
        )
    finally:
        engine.weight_version = "0"
    assert s.token_ids[:2] == [3, 4] and s.logprobs[:2] == [-1.0, -2.0]
    assert s.weight_version == "0" and s.meta["mixed"] is True


def test_bad_prefixes_are_refused(engine):
    with pytest.raises(BadRequestError, match="prefix has 2 tokens and 1 logprobs"):
        asyncio.run(engine.continue_sample(PROMPT, Sample([3, 4], [-1.0], "length")))
    with pytest.raises(BadRequestError, match="needs a prefix of at least one token"):
        asyncio.run(engine.continue_sample(PROMPT, Sample([], [], "length")))


def test_integer_versions_keep_the_smallest_and_an_empty_prefix_is_a_new_request(engine):
    """The async producer's bookkeeping (its continuation of aborted samples goes through here)."""
    pre = Sample([3], [-1.0], "abort", weight_version="2", meta={"mixed": False})
    tail = Sample([4, 5], [-0.5, -0.25], "stop", weight_version="10", stop_reason=5)
    s = join_continuation(pre, tail, version_order=int)
    assert s.token_ids == [3, 4, 5] and s.logprobs == [-1.0, -0.5, -0.25]
    assert s.weight_version == "2" and s.meta["mixed"] is True  # "10" < "2" as text, not as numbers
    assert (s.finish_reason, s.stop_reason) == ("stop", 5)
    sp = SamplingParams(max_new_tokens=2, ignore_eos=True, seed=1)
    empty = Sample([], [], "abort", weight_version="3")
    s = asyncio.run(continue_from_prefix(engine, PROMPT, empty, sp, allow_empty=True, version_order=int))
    fresh = asyncio.run(engine.generate(PROMPT, sampling=sp)).samples[0]
    assert s.token_ids == fresh.token_ids and s.logprobs == fresh.logprobs
    assert s.weight_version == "0" and s.meta["mixed"] is False  # nothing generated under "3"
