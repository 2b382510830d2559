"""Continuous batching in the embedded engine: batched samples vs requests decoded alone."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from megarl.rollout.batching import BatchScheduler, Job
from megarl.rollout.embedded import EmbeddedEngine
from megarl.rollout.sampling import sample_next
from megarl.rollout.types import GenerateRequest, SamplingParams
from tests.rollout.conftest import PROMPT
from tests.rollout.hf_reference import hf_greedy


@pytest.fixture(scope="module")
def engine(tiny_models):
    return EmbeddedEngine.from_pretrained(str(tiny_models["v1"]))


@torch.no_grad()
def decode_alone(model, prompt: list[int], n: int, sp: SamplingParams, stop: set[int] = frozenset()):
    """One request decoded by itself: its n rows from one prefill, one KV cache, one generator
    seeded by ``sp.seed`` drawing for all n rows each step (the engine before batching)."""
    gen = torch.Generator()
    gen.manual_seed(sp.seed)
    out = model(input_ids=torch.tensor([prompt] * n), use_cache=True)
    tokens, logprobs, done = [[] for _ in range(n)], [[] for _ in range(n)], [False] * n
    for _ in range(sp.max_new_tokens):
        nxt, lp = sample_next(out.logits[:, -1, :].float(), sp, gen)
        for i in range(n):
            if not done[i]:
                tokens[i].append(int(nxt[i]))
                logprobs[i].append(float(lp[i]))
                done[i] = tokens[i][-1] in stop
        if all(done):
            break
        out = model(input_ids=nxt.unsqueeze(-1), use_cache=True, cache=out.cache)
    return tokens, logprobs


def sp_of(seed: int, max_new: int = 10, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, seed=seed, ignore_eos=True, **kw)


def test_a_request_decoded_alone_is_bit_identical_to_the_unbatched_loop(engine):
    sp = sp_of(3, temperature=0.8, top_p=0.9)
    res = asyncio.run(engine.generate(PROMPT, n=3, sampling=sp))
    tokens, logprobs = decode_alone(engine.model, PROMPT, 3, sp)
    assert [s.token_ids for s in res.samples] == tokens
    assert [s.logprobs for s in res.samples] == logprobs  # exact: same shapes, no padding mask


def test_requests_joining_and_leaving_mid_decode_sample_as_alone(engine):
    """The batch loop driven step by step (no thread, so the batch composition is fixed): requests
    of different prompt lengths join at steps 0, 3 and 5, others leave early (a short token budget,
    a stop token); every one samples the tokens it samples alone, logprobs to float rounding."""
    prompts = {"a": PROMPT, "b": PROMPT[:5], "c": PROMPT[2:10], "d": PROMPT[:3]}
    plan = {  # name: (n, sampling, step it joins at)
        "a": (2, sp_of(1, 12), 0),
        "b": (3, sp_of(2, 4, top_k=20), 0),
        "c": (1, sp_of(3, 12, temperature=0.7), 3),
        "d": (2, sp_of(4, 9), 5),
    }
    ref = {k: decode_alone(engine.model, prompts[k], n, sp) for k, (n, sp, _) in plan.items()}
    stop = ref["d"][0][0][2]  # d's first sample stops at its third token
    plan["d"] = (2, SamplingParams(max_new_tokens=9, seed=4, ignore_eos=True, stop_token_ids=(stop,)), 5)
    ref["d"] = decode_alone(engine.model, prompts["d"], 2, plan["d"][1], {stop})
    sched = BatchScheduler(engine, max_batch_rows=64)
    jobs = {
        k: Job(req=GenerateRequest(prompts[k], n, sp, request_id=k), abort=threading.Event())
        for k, (n, sp, _) in plan.items()
    }
    padded, rows_seen = False, []
    with engine._lock:
        for step in range(20):
            sched.pending += [jobs[k] for k, (_, _, at) in plan.items() if at == step]
            sched.step()
            rows_seen.append(sched.batch.rows if sched.batch else 0)
            padded |= bool(sched.batch is not None and not sched.batch.mask.all())
    # a's prefill is the scheduler's first (it learns that the cache merges), so b joins at step 1;
    # c joins at 3, b leaves at 4 (its 4 tokens), d joins at 5
    assert padded and rows_seen[:6] == [2, 5, 5, 6, 3, 5] and sched.batch is None
    worst = 0.0
    for k, job in jobs.items():
        samples = job.future.result(timeout=0)
        assert [s.token_ids for s in samples] == ref[k][0], k
        for s, lp in zip(samples, ref[k][1], strict=True):
            worst = max(worst, (torch.tensor(s.logprobs) - torch.tensor(lp)).abs().max().item())
    assert worst < 1e-4
    d_finish = [s.finish_reason for s in jobs["d"].future.result()]
    assert d_finish[0] == "stop" and d_finish == ["stop" if t[-1] == stop else "length" for t in ref["d"][0]]


def test_concurrent_requests_equal_one_at_a_time_and_abort_leaves_the_rest(tiny_models):
    eng = EmbeddedEngine.from_pretrained(str(tiny_models["v1"]))
    prompts = [PROMPT, PROMPT[:4], PROMPT[3:], PROMPT[:7]]
    sps = [sp_of(10 + i, 16) for i in range(4)]

    async def go():
        alone = [await eng.generate(p, n=2, sampling=sp) for p, sp in zip(prompts, sps)]
        together = await asyncio.gather(*[eng.generate(p, n=2, sampling=sp) for p, sp in zip(prompts, sps)])
        long = [
            asyncio.ensure_future(eng.generate(p, n=2, sampling=sp_of(20, 1500), request_id=f"r{i}"))
            for i, p in enumerate(prompts[:3])
        ]

        def steps() -> dict[str, int]:
            return {j.req.request_id: j.steps for j in list(eng._batcher.active)}

        while any(steps().get(f"r{i}", 0) < 5 for i in range(3)):
            await asyncio.sleep(0.005)
        assert await eng.abort("r1") == 1
        await asyncio.sleep(0.05)
        await eng.abort()
        return alone, together, await asyncio.gather(*long)

    alone, together, long = asyncio.run(go())
    for a, b in zip(alone, together, strict=True):
        assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
        for x, y in zip(a.samples, b.samples):
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4)
    first = [len(s.token_ids) for s in long[1].samples]
    rest = [len(s.token_ids) for r in (long[0], long[2]) for s in r.samples]
    assert all(s.finish_reason == "abort" for r in long for s in r.samples)
    assert 0 < max(first) and max(first) < min(rest) < 1500  # r1 left the batch, the others decoded on


def test_a_weight_load_waits_for_the_batch_and_later_requests_get_the_new_weights(tiny_models):
    from safetensors.torch import load_file

    eng = EmbeddedEngine.from_pretrained(str(tiny_models["v1"]))
    state = load_file(str(tiny_models["v2"] / "model.safetensors"))
    greedy = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)

    async def go():
        first = [asyncio.ensure_future(eng.generate(PROMPT, n=2, sampling=sp_of(i, 60))) for i in range(2)]
        while len(eng._batcher.active) < 2:
            await asyncio.sleep(0.005)
        load = asyncio.ensure_future(eng.update_weights_from_tensors(state, version="7"))
        while not eng._draining:
            await asyncio.sleep(0.005)
        later = asyncio.ensure_future(eng.generate(PROMPT, sampling=greedy))
        await load
        return await asyncio.gather(*first), await later

    first, later = asyncio.run(go())
    assert all(s.weight_version == "0" and len(s.token_ids) == 60 for r in first for s in r.samples)
    assert later.samples[0].weight_version == "7"
    assert later.samples[0].token_ids == hf_greedy(str(tiny_models["v2"]), PROMPT, 16)
