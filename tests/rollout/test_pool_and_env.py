"""Pool balancing/retry over real in-process engines, the guessing game, keys and weight-dir checks."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from megarl.rollout.embedded import EmbeddedEngine
from megarl.rollout.environments import GuessingGame
from megarl.rollout.keys import RolloutKeys
from megarl.rollout.pool import BatchItem, EnginePool, PartialRolloutError
from megarl.rollout.types import BadRequestError, NoHealthyEngineError, SamplingParams, WeightsDirError
from megarl.rollout.weights import check_weights_dir
from tests.rollout.conftest import PROMPT
from tests.rollout.decoding import until_decoding


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def three_engines(tiny_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_models["v1"]), dtype="float32")
    return [EmbeddedEngine(model, name=f"e{i}", max_concurrency=2) for i in range(3)]


def test_least_outstanding_balancing(three_engines):
    e0, e1, e2 = three_engines
    pool = EnginePool(three_engines)

    async def go():
        # Three concurrent requests land on three different engines.
        results = await asyncio.gather(
            *(pool.generate(PROMPT, sampling=SamplingParams(max_new_tokens=4, seed=i)) for i in range(3))
        )
        assert sorted(r.engine for r in results) == ["e0", "e1", "e2"]
        # With e0 holding two requests and e2 one, the next request goes to e1.
        busy = [
            asyncio.ensure_future(
                e.generate(PROMPT, sampling=SamplingParams(max_new_tokens=200, ignore_eos=True))
            )
            for e in (e0, e0, e2)
        ]
        await asyncio.sleep(0)
        assert (e0.outstanding, e1.outstanding, e2.outstanding) == (2, 0, 1)
        nxt = await pool.generate(PROMPT, sampling=SamplingParams(max_new_tokens=2))
        await asyncio.gather(*busy)
        return nxt

    assert run(go()).engine == "e1"


def test_dead_engine_marked_down_and_requests_retried(three_engines):
    e0, e1, e2 = three_engines
    pool = EnginePool(three_engines, max_attempts=3)

    async def go():
        items = [
            BatchItem(PROMPT, sampling=SamplingParams(max_new_tokens=300, ignore_eos=True, seed=i))
            for i in range(6)
        ]
        task = asyncio.ensure_future(pool.generate_batch(items))
        await until_decoding(e0)  # a token into its 300
        e0.shutdown("killed by test")  # its in-flight requests fail at their next decode step
        return await task

    results = run(go())
    assert len(results) == 6 and all(len(r.samples[0].token_ids) == 300 for r in results)
    assert all(r.engine in ("e1", "e2") for r in results)
    assert "killed by test" in pool.members[0].down_reason and pool.members[0].failures
    assert pool.up == [e1, e2]


def test_no_engine_left_is_a_clear_error_and_finished_results_are_kept(three_engines):
    e0, e1, e2 = three_engines
    pool = EnginePool([e0, e1], max_attempts=3)

    async def go():
        done = await pool.generate(PROMPT, sampling=SamplingParams(max_new_tokens=2))
        e0.shutdown("node lost")
        e1.shutdown("node lost too")
        with pytest.raises(NoHealthyEngineError, match="e0: .*node lost.*e1: .*node lost too"):
            await pool.generate(PROMPT)
        return done

    assert len(run(go()).samples[0].token_ids) == 2

    # A batch where some requests finish before the last engine dies keeps those results.
    pool2 = EnginePool([e2])

    async def go2():
        items = [BatchItem(PROMPT, sampling=SamplingParams(max_new_tokens=2))] * 2 + [
            BatchItem(PROMPT, sampling=SamplingParams(max_new_tokens=1900, ignore_eos=True))
        ]
        task = asyncio.ensure_future(pool2.generate_batch(items))
        while pool2.members[0].served < 2:
            await asyncio.sleep(0.01)
        e2.shutdown("gone")
        with pytest.raises(PartialRolloutError, match="1 of 3 requests failed") as err:
            await task
        return err.value

    err = run(go2())
    assert [r is not None for r in err.results] == [True, True, False]
    assert isinstance(err.errors[2], NoHealthyEngineError)


def test_bad_request_is_not_retried(three_engines):
    pool = EnginePool(three_engines)
    with pytest.raises(BadRequestError, match="outside the vocabulary"):
        run(pool.generate([1, 99999]))
    assert all(m.down_reason is None and not m.failures for m in pool.members)


def test_guessing_game_rules(tiny_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_models["v1"]))
    env = GuessingGame(tok, lo=1, hi=100, max_turns=3)
    prompt = env.reset(seed=4)
    assert "Guess my number" in tok.decode(prompt)
    secret = env.secret
    low = env.step(tok.encode(f" {secret - 1}", add_special_tokens=False))
    assert "too low" in tok.decode(low.observation_ids) and not low.done and low.reward == 0
    none = env.step(tok.encode(" no idea", add_special_tokens=False))
    assert "no number" in tok.decode(none.observation_ids) and not none.done
    hit = env.step(tok.encode(f" it is {secret}", add_special_tokens=False))
    assert hit.reward == 1.0 and hit.done
    env.reset(seed=4)
    for _ in range(2):
        assert not env.step(tok.encode(f" {secret + 1}", add_special_tokens=False)).done
    last = env.step(tok.encode(f" {secret + 1}", add_special_tokens=False))
    assert last.done and last.reward == 0 and "too high" in tok.decode(last.observation_ids)


def test_key_file_is_private_and_round_trips(tmp_path):
    keys = RolloutKeys.generate()
    assert keys.api_key != keys.admin_key and len(keys.api_key) >= 40
    p = keys.write(tmp_path / "keys.json")
    assert os.stat(p).st_mode & 0o777 == 0o600
    assert RolloutKeys.read(p) == keys
    assert RolloutKeys.from_env({"MEGARL_ROLLOUT_KEY_FILE": str(p)}) == keys
    os.chmod(p, 0o644)
    with pytest.raises(PermissionError, match="owner only"):
        RolloutKeys.read(p)


def test_weights_dir_checks(tiny_models, tmp_path):
    names = check_weights_dir(tiny_models["v1"])
    assert "lm_head.weight" in names
    assert check_weights_dir(tiny_models["v2"], names) == names
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    (bad / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(WeightsDirError, match="model.safetensors: not a readable safetensors file"):
        check_weights_dir(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(WeightsDirError, match="config.json: not valid JSON"):
        check_weights_dir(bad)
    import torch
    from safetensors.torch import save_file

    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(other / "model.safetensors"))
    with pytest.raises(WeightsDirError, match="tensor names differ from the served model: missing"):
        check_weights_dir(other, names)


def test_vllm_routed_experts_payload_decodes():
    """vLLM 0.32 sends routed experts as base64 of a .npy array (see its CompletionResponseChoice)."""
    import base64
    import io

    import numpy as np

    from megarl.rollout.vllm_client import decode_routed_experts

    arr = np.arange(5 * 3 * 2, dtype=np.uint8).reshape(5, 3, 2)
    buf = io.BytesIO()
    np.save(buf, arr)
    out = decode_routed_experts(base64.b64encode(buf.getvalue()).decode())
    assert out.shape == (5, 3, 2) and out.dtype == torch.int64 and out.tolist() == arr.tolist()
    assert decode_routed_experts(None) is None


def test_make_engine_defaults_to_embedded_without_servers(tiny_models):
    from megarl.rollout import make_engine
    from megarl.rollout.sglang_client import SGLangEngine
    from megarl.rollout.vllm_client import VLLMEngine

    async def go():
        emb = make_engine(None, model_dir=str(tiny_models["v1"]))
        assert isinstance(emb, EmbeddedEngine)
        one = make_engine(["http://127.0.0.1:1"], kind="sglang")
        two = make_engine(["http://127.0.0.1:1", "http://127.0.0.1:2"], kind="vllm", model="tiny")
        assert isinstance(one, SGLangEngine) and isinstance(two, EnginePool)
        assert all(isinstance(m.engine, VLLMEngine) for m in two.members)
        for e in (one, two):
            await e.close()

    asyncio.run(go())
    with pytest.raises(ValueError, match="no server configured and no model_dir"):
        from megarl.rollout import make_engine

        make_engine([])
    with pytest.raises(ValueError, match="unknown engine kind 'tgi'"):
        from megarl.rollout import make_engine

        make_engine(["http://x"], kind="tgi")
