"""The SGLang client against a REAL SGLang 0.5.23 server on CPU (the venv of tests/setup/40-sglang.sh).

One server per module, launched by ``megarl.rollout.server_process.launch_sglang`` with
``device="cpu"`` (``$MEGARL_SGLANG_DEVICE``; tests/rollout/gpu_sglang.sh sets ``cuda``) on the tiny
random Qwen3 in fp32, so that greedy output can be compared with transformers token for token.
Without ``.venv-sglang`` (or ``$MEGARL_SGLANG_PYTHON``) every test here skips with the command that
makes it, and fails under CI (tests/sglang_venv.py; ``make setup`` installs the venv). The same client is
tested against recorded transcripts in test_sglang_replay.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import pytest
import torch

from megarl.rollout.embedded import teacher_forced_logprobs
from megarl.rollout.server_process import SGLangServerConfig, launch_sglang
from megarl.rollout.types import AuthError, BadRequestError, SamplingParams, WeightsDirError
from tests.rollout.conftest import PROMPT
from tests.rollout.hf_reference import hf_greedy, load_hf
from tests.sglang_venv import require_sglang_python

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
LOGPROB_ATOL = 1e-3  # fp32 server (torch_native attention) vs fp32 transformers recomputation
LONG = 1000  # tokens of a request meant to be cut by an abort or a pause (prompt + LONG < 1024)
MIN_DECODED = 4  # new tokens each such request has before the test acts on it


@pytest.fixture(scope="module")
def sglang_server(tiny_models, tmp_path_factory):
    python = require_sglang_python()
    cfg = SGLangServerConfig(
        model_dir=str(tiny_models["v1"]),
        python=python,
        device=os.environ.get("MEGARL_SGLANG_DEVICE", "cpu"),
        dtype="float32",
        max_total_tokens=8192,
        weight_version="v1",
        startup_timeout_s=900,
        work_dir=str(tmp_path_factory.mktemp("sglang")),
    )
    t0 = time.monotonic()
    server = launch_sglang(cfg)
    print(f"\nSGLang (CPU) server healthy after {time.monotonic() - t0:.1f} s")
    yield server
    server.stop()


def run(coro):
    return asyncio.run(coro)


async def _started(eng, *rids: str, samples: int | None = None, timeout_s: float = 60.0) -> None:
    """Wait until the requests ``rids`` are decoding on the server: their HTTP calls sent, and the
    server's ``/v1/loads`` reporting ``samples`` sequences running (default: one per rid; SGLang
    runs each of a request's n samples as its own) whose KV cache holds the prompt and at least
    MIN_DECODED new tokens per sequence. Waiting on the server's own report instead of a fixed
    time keeps the LONG requests far from done when a test acts, however fast the server."""
    samples = len(rids) if samples is None else samples
    deadline = time.monotonic() + timeout_s
    while not all(rid in eng._inflight for rid in rids):
        assert time.monotonic() < deadline, f"requests {rids} never started"
        await asyncio.sleep(0.02)
    want = len(PROMPT) + samples * MIN_DECODED
    while True:
        loads = (await eng.request("GET", "/v1/loads"))["loads"]
        running = sum(x["num_running_reqs"] for x in loads)
        used = sum(x["num_used_tokens"] for x in loads)
        if running >= samples and used >= want:
            return
        assert time.monotonic() < deadline, (
            f"{rids}: {running} running, {used} tokens in use after {timeout_s} s"
        )
        await asyncio.sleep(0.02)


def test_live_samples_logprobs_and_version_label(sglang_server, tiny_models):
    async def go():
        async with sglang_server.client() as eng:
            t0 = time.monotonic()
            r = await eng.generate(PROMPT, 4, SamplingParams(max_new_tokens=32, ignore_eos=True))
            dt = time.monotonic() - t0
            seeded = [
                (await eng.generate(PROMPT, 2, SamplingParams(max_new_tokens=12, seed=7))).samples
                for _ in range(2)
            ]
            return r, dt, seeded

    r, dt, seeded = run(go())
    print(f"\nn=4 x 32 tokens in {dt:.2f} s ({4 * 32 / dt:.0f} tokens/s)")
    assert len(r.samples) == 4
    model = load_hf(str(tiny_models["v1"]), "float32")
    for s in r.samples:
        assert len(s.token_ids) == len(s.logprobs) == 32 and s.finish_reason == "length"
        assert all(0 <= t < 1024 for t in s.token_ids)
        ref = teacher_forced_logprobs(model, PROMPT, s.token_ids)
        assert (torch.tensor(s.logprobs) - ref).abs().max().item() < LOGPROB_ATOL
        # a fresh server labels its samples with the launcher's initial version, not "default"
        assert s.weight_version == "v1"
    assert len({tuple(s.token_ids) for s in r.samples}) > 1  # n samples are drawn independently
    for samples in seeded:
        assert len(samples) == 2 and all(len(s.token_ids) == len(s.logprobs) > 0 for s in samples)


def test_live_engine_teacher_equals_megatron_teacher(sglang_server, tiny_models):
    """teacher.source: engine with SGLang's input logprobs: the student's tokens scored by the
    server equal the forward-only Megatron teacher's logprobs on the same weights (fp32); the
    top-K ids equal transformers'. Measured once on CPU: max |diff| 4.8e-7 against transformers."""
    from megarl.plugin.engine_teacher import EngineTeacherPass
    from tests.methods.teacher_cases import megatron_teacher_logprobs, student_batch

    batch = student_batch(1024, PROMPT)
    want = megatron_teacher_logprobs(tiny_models["v1"], batch)
    p = EngineTeacherPass([sglang_server.client()], top_k=3)
    p.fill(batch, 1)
    p.close()
    diff = float((batch.teacher_logprobs - want).abs().max())
    print(f"SGLang (fp32) engine teacher vs Megatron (fp32) teacher: max |diff| = {diff:.2e}")
    assert diff < LOGPROB_ATOL
    model = load_hf(str(tiny_models["v1"]), "float32")
    with torch.no_grad():
        seq = batch.tokens[: int(batch.cu_seqlens[1])]
        ref = torch.log_softmax(model(input_ids=seq.unsqueeze(0)).logits[0, :-1].float(), -1)
    got = batch.token_extras["teacher_topk_ids"][1 : len(seq)]
    assert torch.equal(got, ref.topk(3, -1).indices)


def test_live_greedy_reload_revert_and_failed_update(sglang_server, tiny_models, tmp_path):
    v1, v2 = str(tiny_models["v1"]), str(tiny_models["v2"])

    async def go():
        async with sglang_server.client() as eng:
            g1 = (await eng.generate(PROMPT, 1, GREEDY)).samples[0]
            t0 = time.monotonic()
            await eng.update_weights(v2, "v2")
            reload_s = time.monotonic() - t0
            g2 = (await eng.generate(PROMPT, 1, GREEDY)).samples[0]
            info = await eng.model_info()
            await eng.update_weights(v1, "v1")
            g3 = (await eng.generate(PROMPT, 1, GREEDY)).samples[0]
            with pytest.raises(WeightsDirError, match="keeps the old weights"):
                await eng.update_weights(str(tmp_path / "missing"), check_dir=False)
            assert eng.dead_reason is None and await eng.health()
            g4 = (await eng.generate(PROMPT, 1, GREEDY)).samples[0]
            return g1, g2, g3, g4, info, reload_s

    g1, g2, g3, g4, info, reload_s = run(go())
    print(f"\nupdate_weights_from_disk (tiny model): {reload_s:.2f} s")
    assert g1.token_ids == hf_greedy(v1, PROMPT, 16) == g3.token_ids == g4.token_ids
    assert g2.token_ids == hf_greedy(v2, PROMPT, 16) != g1.token_ids
    assert g2.weight_version == "v2" and info["weight_version"] == "v2" and info["model_path"] == v2
    assert g3.weight_version == g4.weight_version == "v1"


def test_live_flush_and_pause_modes(sglang_server):
    async def go():
        async with sglang_server.client() as eng:
            assert await eng.flush_cache(wait_s=10.0)
            # in place: the running request is frozen, flush is refused, then it finishes whole
            t = asyncio.ensure_future(
                eng.generate(
                    PROMPT, 1, SamplingParams(max_new_tokens=LONG, ignore_eos=True), request_id="pip"
                )
            )
            await _started(eng, "pip")
            await eng.pause("in_place")
            refused = not await eng.flush_cache()
            await eng.resume()
            kept = (await t).samples[0]
            # abort mode: the running request returns at once with its partial output
            t = asyncio.ensure_future(
                eng.generate(
                    PROMPT, 1, SamplingParams(max_new_tokens=LONG, ignore_eos=True), request_id="pab"
                )
            )
            await _started(eng, "pab")
            await eng.pause("abort")
            cut = (await t).samples[0]
            await eng.resume()
            after = (await eng.generate(PROMPT, 1, GREEDY)).samples[0]
            return refused, kept, cut, after

    refused, kept, cut, after = run(go())
    assert refused
    assert kept.finish_reason == "length" and len(kept.token_ids) == LONG
    assert cut.finish_reason == "abort" and 0 < len(cut.token_ids) < LONG
    assert len(after.token_ids) == 16


@pytest.mark.parametrize("n", [1, 2])
def test_live_abort_by_request_id(sglang_server, n):
    """Aborting a request by its id ends every one of its samples, for n = 1 and n > 1."""

    async def go():
        async with sglang_server.client() as eng:
            sp = SamplingParams(max_new_tokens=LONG, ignore_eos=True)
            t0 = time.monotonic()
            t = asyncio.ensure_future(eng.generate(PROMPT, n, sp, request_id=f"cut-{n}"))
            await _started(eng, f"cut-{n}", samples=n)
            await eng.abort(f"cut-{n}")
            r = await asyncio.wait_for(t, 60)
            return r, time.monotonic() - t0

    r, elapsed = run(go())
    print(f"\nn={n}: aborted after {elapsed:.1f} s")
    assert len(r.samples) == n
    for s in r.samples:
        assert s.finish_reason == "abort" and len(s.token_ids) < LONG


def test_live_abort_cuts_only_the_named_request(sglang_server):
    """SGLang aborts every request whose id starts with the id given: aborting "p-1" must not cut
    "p-10" (the engine's own ids are "megarl-<pid>-<counter>", so such pairs are common). A cut
    request returns within about 0.1 s of the abort; "p-10" must still be running 0.5 s after "p-1"
    returned, and is then aborted itself."""

    async def go():
        async with sglang_server.client() as eng:
            sp = SamplingParams(max_new_tokens=LONG, ignore_eos=True)
            victim = asyncio.ensure_future(eng.generate(PROMPT, 1, sp, request_id="p-1"))
            other = asyncio.ensure_future(eng.generate(PROMPT, 2, sp, request_id="p-10"))
            await _started(eng, "p-1", "p-10", samples=3)
            await eng.abort("p-1")
            cut = (await victim).samples
            await asyncio.sleep(0.5)
            running = not other.done()
            await eng.abort("p-10")
            return cut, running, (await other).samples

    cut, running, later = run(go())
    assert cut[0].finish_reason == "abort"
    assert running
    assert [s.finish_reason for s in later] == ["abort"] * 2


def test_live_bad_requests_and_health(sglang_server):
    async def go():
        async with sglang_server.client() as eng:
            with pytest.raises(BadRequestError, match="outside the vocabulary|has id 1024"):
                await eng.generate([5, 1024, 5000])
            with pytest.raises(BadRequestError, match="max_new_tokens must be at least 0"):
                await eng.request(
                    "POST",
                    "/generate",
                    json_body={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -1}},
                )
            await eng.abort("no-such-rid")  # an unknown id is not an error
            return await eng.health(), await eng.health(generate=True)

    assert run(go()) == (True, True)
    assert sglang_server.alive()


def test_live_key_policy(sglang_server, tiny_models):
    keys = sglang_server.keys
    with httpx.Client(base_url=sglang_server.url, timeout=120) as c:
        gen = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        upd = {"model_path": str(tiny_models["v1"])}
        assert c.get("/health").status_code == 200
        assert c.post("/generate", json=gen).status_code == 401
        assert c.post("/update_weights_from_disk", json=upd).status_code == 401
        api = {"Authorization": f"Bearer {keys.api_key}"}
        assert c.post("/update_weights_from_disk", json=upd, headers=api).status_code == 401
        assert c.post("/generate", json=gen, headers=api).status_code == 200
    cmdline = open(f"/proc/{sglang_server.proc.pid}/cmdline", "rb").read().decode()
    assert keys.api_key not in cmdline and keys.admin_key not in cmdline
    # SGLang prints its arguments, keys included, into the log: only this user may read it
    assert sglang_server.log_path.stat().st_mode & 0o077 == 0

    async def go():
        async with sglang_server.client(admin_key=keys.api_key) as eng:
            with pytest.raises(AuthError):
                await eng.pause()

    run(go())


def _state(model_dir) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


def test_live_memory_sync_streams_buckets_and_labels_the_version(sglang_server, tiny_models):
    """rollout.weight_sync: memory with SGLang: the weights travel over a gloo group into the
    server (no checkpoint on disk), in many small buckets; SGLang's checksum of every parameter
    equals the trainer's; greedy output then equals transformers' on the new weights and samples
    carry the new version; syncing v1 back restores v1's output."""
    from megarl.rollout.memory_sync import plan_buckets
    from megarl.rollout.sglang_sync import EngineDigests, engine_name

    v1, v2 = str(tiny_models["v1"]), str(tiny_models["v2"])

    async def go():
        async with sglang_server.client() as eng:
            state = _state(v2)
            buckets = plan_buckets(state, bucket_bytes=64 << 10)
            t0 = time.monotonic()
            await eng.update_weights_streamed(list(state), iter(buckets), "v2m")
            sync_s = time.monotonic() - t0
            g2 = (await eng.generate(PROMPT, 1, GREEDY)).samples[0]
            info = await eng.model_info()
            check = dict(eng.last_sync_check)
            # the check can fail: v1's digests against the server holding v2 differ wherever
            # the two weight sets do (the norms, all ones in both, do not)
            stale, old = EngineDigests(torch.float32), _state(v1)
            for name, t in old.items():
                stale.add(name, t)
            answer = await eng.request("POST", "/weights_checker", json_body={}, admin=True)
            stale_checked, stale_differ = stale.compare(answer["ranks"][0]["checksums"])
            changed = {engine_name(k)[0] for k in old if not torch.equal(old[k], state[k])}
            await eng.update_weights_from_tensors(_state(v1), "v1m")
            g1 = (await eng.generate(PROMPT, 1, GREEDY)).samples[0]
            await eng.update_weights(v1, "v1")  # the label the other tests expect
            return len(buckets), sync_s, g2, info, g1, check, (stale_checked, set(stale_differ), changed)

    n, sync_s, g2, info, g1, check, stale = run(go())
    print(f"\nin-memory sync of the tiny model in {n} buckets: {sync_s:.2f} s")
    assert n > 5
    assert g2.token_ids == hf_greedy(v2, PROMPT, 16) and g2.weight_version == "v2m"
    assert info["weight_version"] == "v2m"
    assert g1.token_ids == hf_greedy(v1, PROMPT, 16) and g1.weight_version == "v1m"
    # SGLang's own checksum of every parameter written (q/k/v and gate/up fused) = the trainer's
    assert check["differ"] == [] and check["checked"] == check["sent"] == 19
    stale_checked, stale_differ, changed = stale
    assert stale_checked == 19 and stale_differ == changed and len(changed) == 10


def test_live_memory_sync_interrupted(sglang_server, tiny_models):
    """A sync that fails before its first bucket leaves the server on the old weights and version
    (engine still up); one that fails after a bucket reached the server (weights partly new) marks
    the engine dead, and a pool drains it. A disk reload then restores the server."""
    from megarl.rollout.memory_sync import plan_buckets
    from megarl.rollout.pool import EnginePool
    from megarl.rollout.types import EngineDeadError, NoHealthyEngineError

    v1, v2 = str(tiny_models["v1"]), str(tiny_models["v2"])
    state = _state(v2)
    buckets = plan_buckets(state, bucket_bytes=64 << 10)

    def failing_after(k: int):
        yield from buckets[:k]
        raise RuntimeError("the learner's gather failed")

    async def go():
        async with sglang_server.client() as eng:
            with pytest.raises(RuntimeError, match="gather failed"):
                await eng.update_weights_streamed(list(state), failing_after(0), "never")
            untouched = (eng.dead_reason, (await eng.generate(PROMPT, 1, GREEDY)).samples[0])
        eng = sglang_server.client()
        pool = EnginePool([eng])
        with pytest.raises(NoHealthyEngineError):
            await pool.update_weights_streamed(list(state), failing_after(2), "never")
        dead = eng.dead_reason
        with pytest.raises(EngineDeadError):
            await eng.generate(PROMPT, 1, GREEDY)
        await pool.close()
        async with sglang_server.client() as fresh:
            await fresh.update_weights(v1, "v1")
            restored = (await fresh.generate(PROMPT, 1, GREEDY)).samples[0]
        return untouched, dead, restored

    (dead_before, kept), dead, restored = run(go())
    assert dead_before is None
    assert kept.token_ids == hf_greedy(v1, PROMPT, 16) and kept.weight_version == "v1"
    assert dead is not None and "after 2 bucket(s) started" in dead
    assert restored.token_ids == hf_greedy(v1, PROMPT, 16) != hf_greedy(v2, PROMPT, 16)


def test_live_trainer_engine_keys_and_vocabulary_guard(sglang_server, monkeypatch):
    """The engine the trainer builds for servers at rollout.urls presents the job's keys (from
    the environment) and refuses an out-of-vocabulary id client-side: such an id kills SGLang."""
    from megarl.rollout.keys import ADMIN_KEY_ENV, API_KEY_ENV
    from megarl.trainer.config_sections import RolloutConfig
    from megarl.trainer.servers import connect_servers

    monkeypatch.setenv(API_KEY_ENV, sglang_server.keys.api_key)
    monkeypatch.setenv(ADMIN_KEY_ENV, sglang_server.keys.admin_key)
    r = RolloutConfig(engine="sglang", urls=[sglang_server.url])
    eng = connect_servers(r, log=lambda *_: None, vocab_size=sglang_server.vocab_size)

    async def go():
        try:
            ok = (await eng.generate(PROMPT, 1, GREEDY)).samples[0]
            with pytest.raises(BadRequestError, match="1024"):
                await eng.generate([5, 1024, 7])
            assert await eng.flush_cache(wait_s=10.0)  # the admin key reaches a control route
            return ok
        finally:
            await eng.close()

    assert len(run(go()).token_ids) == 16
    assert sglang_server.alive()


# The recorded requests (megarl/testing/data/sglang-0.5.23.jsonl) that the tests above do not send in
# another form: each goes to the live server as recorded; the answer must have the recorded status,
# content type and JSON shape (keys; list lengths of n > 1 answers). The stateful records (weight
# updates, pause, abort) are covered by the tests above, the crash by the last test of this file.
RECORDED_LIVE = (
    "health",
    "health_generate",
    "get_model_info",
    "get_server_info",
    "generate_n1",
    "generate_n4",
    "generate_logprobs",
    "generate_logprobs_start5",
    "generate_stop_token_ids",
    "generate_ignore_eos",
    "generate_text_prompt",
    "v1_completions_n2_logprobs",
    "v1_chat_completions_n2_logprobs",
    "v1_models",
    "bad_generate_missing_input",
    "bad_generate_negative_max_new_tokens",
    "bad_generate_invalid_json",
    "bad_v1_completions_invalid_json",
    "bad_unknown_endpoint",
)


def _recorded() -> dict[str, dict]:
    from megarl.testing.tiny_qwen3 import transcript_path

    lines = transcript_path("sglang-0.5.23.jsonl").read_text().splitlines()
    return {rec["name"]: rec for rec in map(json.loads, lines)}


def _shape(x, count: bool = True):
    """Keys of dicts (recursively) and the number of answers or choices, not values (nor the lengths
    of token lists, which end early at a sampled end of sequence)."""
    if isinstance(x, dict):
        nested = {k: _shape(v, k == "choices") for k, v in x.items() if isinstance(v, dict | list)}
        return nested | {"keys": sorted(x)}
    if isinstance(x, list):
        first = [_shape(x[0], False)] if x and isinstance(x[0], dict) else []
        return ([len(x)] if count else []) + first
    return None


def test_live_answers_the_recorded_requests(sglang_server, tiny_models):
    from megarl.testing.replay_server import SGLANG_ADMIN_ROUTES

    recs = _recorded()
    keys = sglang_server.keys
    model = str(tiny_models["v1"])
    mismatched = []
    with httpx.Client(base_url=sglang_server.url, timeout=120) as c:
        for name in RECORDED_LIVE:
            rec = recs[name]
            key = keys.admin_key if rec["path"].split("?")[0] in SGLANG_ADMIN_ROUTES else keys.api_key
            kw: dict = {"headers": {"Authorization": f"Bearer {key}"}}
            if rec.get("request_json") is not None:
                kw["content"] = json.dumps(rec["request_json"]).replace("MODEL_DIR", model)
                kw["headers"]["Content-Type"] = "application/json"
            elif rec.get("request_text") is not None:
                kw["content"] = rec["request_text"]
                kw["headers"]["Content-Type"] = "application/json"
            r = c.request(rec["method"], rec["path"], **kw)
            got = {"status": r.status_code, "type": r.headers.get("content-type")}
            want = {"status": rec["status"], "type": rec.get("response_content_type")}
            if "response_json" in rec:
                got["shape"], want["shape"] = _shape(r.json()), _shape(rec["response_json"])
            if got != want:
                mismatched.append((name, {k: (got[k], want[k]) for k in got if got[k] != want[k]}))
    assert mismatched == []


def test_live_trainer_engine_key_sources(sglang_server, tiny_models, tmp_path, monkeypatch):
    """The trainer's engine for servers at ``rollout.urls`` takes its keys from ``rollout.key_file``
    or ``$MEGARL_ROLLOUT_KEY_FILE`` (the env pair is tested above); without keys a control route
    answers 401 and the error says where keys come from."""
    from megarl.rollout.keys import ADMIN_KEY_ENV, API_KEY_ENV, KEY_FILE_ENV
    from megarl.trainer.config_sections import RolloutConfig
    from megarl.trainer.servers import connect_servers

    for name in (KEY_FILE_ENV, API_KEY_ENV, ADMIN_KEY_ENV):
        monkeypatch.delenv(name, raising=False)
    path = sglang_server.keys.write(tmp_path / "keys.json")

    async def flush(r: RolloutConfig) -> bool:
        eng = connect_servers(r, log=lambda *_: None, vocab_size=sglang_server.vocab_size)
        try:
            return await eng.flush_cache(wait_s=10.0)
        finally:
            await eng.close()

    assert run(flush(RolloutConfig(engine="sglang", urls=[sglang_server.url], key_file=str(path))))
    monkeypatch.setenv(KEY_FILE_ENV, str(path))
    assert run(flush(RolloutConfig(engine="sglang", urls=[sglang_server.url])))
    monkeypatch.delenv(KEY_FILE_ENV)
    with pytest.raises(AuthError, match=f"401.*no key was sent.*rollout.key_file.*{KEY_FILE_ENV}"):
        run(flush(RolloutConfig(engine="sglang", urls=[sglang_server.url])))


def test_live_out_of_vocabulary_id_kills_the_server_last(sglang_server):
    """Sent past the client's guard, a prompt id outside the vocabulary kills SGLang: the request
    fails with EngineDeadError, then /health and new connections fail. Runs last in this file (the
    module's server does not survive it)."""
    from megarl.rollout.types import EngineDeadError

    async def go():
        async with sglang_server.client() as eng:
            with pytest.raises(EngineDeadError, match="RemoteProtocolError|ReadError|connection"):
                await eng.request(
                    "POST",
                    "/generate",
                    json_body={"input_ids": [5, 1024, 5000], "sampling_params": {"max_new_tokens": 4}},
                )
            assert not await eng.health()
        deadline = time.monotonic() + 60
        while True:
            async with sglang_server.client() as fresh:
                if not await fresh.health():
                    return fresh.dead_reason
            assert time.monotonic() < deadline, "the server still answers /health 60 s after the crash"
            await asyncio.sleep(0.5)

    reason = run(go())
    assert reason and "ConnectError" in reason
