"""Continuous batching in the embedded engine: batched samples vs requests decoded alone."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from megarl.rollout.batching import BatchScheduler, Job
from megarl.rollout.embedded import EmbeddedEngine
from megarl.rollout.sampling import sample_next
from megarl.rollout.types import GenerateRequest, SamplingParams
from tests.rollout.conftest import PROMPT
from tests.rollout.decoding import DecodeHold, tokens_sampled
from tests.rollout.hf_reference import hf_greedy


@pytest.fixture(scope="module")
def engine(tiny_models):
    return EmbeddedEngine.from_pretrained(str(tiny_models["v1"]))


@torch.no_grad()
def decode_alone(
    model, prompt: list[int], n: int, sp: SamplingParams, stop: set[int] = frozenset(), shared: bool = True
):
    """One request decoded by itself: one KV cache of n rows, one generator seeded by ``sp.seed``
    drawing for all n rows each step. ``shared``: the prompt is prefilled once (last-position
    logits only) and its keys, values and logits repeated n times, as the engine does; else it is
    prefilled n times in one forward of n rows (the engine before it shared the prompt)."""
    gen = torch.Generator()
    gen.manual_seed(sp.seed)
    if shared:
        out = model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        for layer in out.cache.layers:
            layer.keys, layer.values = (
                layer.keys.repeat_interleave(n, 0),
                layer.values.repeat_interleave(n, 0),
            )
        out.logits = out.logits.repeat_interleave(n, 0)
    else:
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
        cut = max(len(s.token_ids) for s in (await long[1]).samples)  # r1 has left the batch
        while all(tokens_sampled(eng, f"r{i}") for i in (0, 2)) and any(
            tokens_sampled(eng, f"r{i}") <= cut for i in (0, 2)
        ):  # until the other two have decoded past r1 (or left the batch, which the asserts catch)
            await asyncio.sleep(0.002)
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

    # a decode step of the two first requests waits until the load drains and ``later`` is queued
    hold = DecodeHold(eng, lambda: len(eng._batcher.active) == 2)

    async def go():
        first = [asyncio.ensure_future(eng.generate(PROMPT, n=2, sampling=sp_of(i, 60))) for i in range(2)]
        while len(eng._batcher.active) < 2:
            await asyncio.sleep(0.005)
        load = asyncio.ensure_future(eng.update_weights_from_tensors(state, version="7"))
        while not eng._draining:
            await asyncio.sleep(0.005)
        later = asyncio.ensure_future(eng.generate(PROMPT, sampling=greedy))
        while not eng._batcher.pending:  # queued behind the load, not admitted
            await asyncio.sleep(0.005)
        hold.release()
        await load
        return await asyncio.gather(*first), await later

    try:
        first, later = asyncio.run(go())
    finally:
        hold.release()
    assert all(s.weight_version == "0" and len(s.token_ids) == 60 for r in first for s in r.samples)
    assert later.samples[0].weight_version == "7"
    assert later.samples[0].token_ids == hf_greedy(str(tiny_models["v2"]), PROMPT, 16)


def test_a_burst_of_requests_is_prefilled_together_once_per_prompt(engine, monkeypatch):
    """Requests gathered in one event-loop turn are admitted at one step: one prefill forward per
    prompt length with one row per request (its n rows share the prompt's cache), even when the
    loop thread is slow between submissions (a loaded machine; the sleep lets the worker run)."""
    prompts = [PROMPT[:6], PROMPT[1:7], PROMPT[2:8], PROMPT[3:9], PROMPT, PROMPT[::-1]]
    sps = [sp_of(30 + i, 6) for i in range(len(prompts))]
    submit = engine._batcher.submit

    def slow_submit(*args, **kw):
        submit(*args, **kw)
        time.sleep(0.02)

    monkeypatch.setattr(engine._batcher, "submit", slow_submit)
    shapes: list[tuple[int, int]] = []

    def record(module, args, kw):
        ids = kw["input_ids"]
        if ids.shape[1] > 1:
            shapes.append(tuple(ids.shape))

    hook = engine.model.register_forward_pre_hook(record, with_kwargs=True)

    async def go():
        return await asyncio.gather(*[engine.generate(p, n=3, sampling=sp) for p, sp in zip(prompts, sps)])

    try:
        results = asyncio.run(go())
    finally:
        hook.remove()
    assert shapes == [(4, 6), (2, len(PROMPT))]
    worst = 0.0
    for p, sp, res in zip(prompts, sps, results, strict=True):
        tokens, logprobs = decode_alone(engine.model, p, 3, sp, shared=False)  # n prompt rows
        assert [s.token_ids for s in res.samples] == tokens
        for s, lp in zip(res.samples, logprobs, strict=True):
            worst = max(worst, (torch.tensor(s.logprobs) - torch.tensor(lp)).abs().max().item())
    assert worst < 1e-4


def _sample_next_multinomial(logits: torch.Tensor, sp: SamplingParams, gen: torch.Generator):
    """Sampling of one request with ``torch.multinomial`` (the engine's sampler before it batched)."""
    from megarl.rollout.sampling import filter_logits

    logp = torch.log_softmax(logits, dim=-1)
    if sp.temperature == 0:
        nxt = logits.argmax(-1)
    else:
        probs = torch.softmax(filter_logits(logits / sp.temperature, sp.top_k, sp.top_p), dim=-1)
        nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    return nxt, logp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)


def test_sampling_a_batch_equals_each_request_alone_bit_for_bit():
    """``sample_rows`` over requests of mixed n, temperatures (greedy included), top-k and top-p
    draws per request exactly what ``torch.multinomial`` draws for its rows alone, over steps."""
    from megarl.rollout.sampling import sample_rows

    ns = [3, 1, 8, 2, 5, 4]
    sps = [
        SamplingParams(temperature=t, top_k=k, top_p=p, seed=i)
        for i, (t, k, p) in enumerate(
            [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.0, 0, 0.9), (0.0, 0, 1.0), (1.0, 0, 1.0), (1.3, 3, 0.8)]
        )
    ]
    mine = [torch.Generator().manual_seed(100 + i) for i in range(len(ns))]
    ref = [torch.Generator().manual_seed(100 + i) for i in range(len(ns))]
    torch.manual_seed(0)
    for _ in range(4):
        for V in (24, 1000):
            logits = torch.randn(sum(ns), V) * 3
            nxt, lp = sample_rows(logits, list(zip(ns, sps, mine)))
            row = 0
            for n, sp, gen in zip(ns, sps, ref):
                a, b = _sample_next_multinomial(logits[row : row + n], sp, gen)
                assert torch.equal(nxt[row : row + n], a) and torch.equal(lp[row : row + n], b)
                row += n
