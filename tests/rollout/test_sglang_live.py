"""The SGLang client against a REAL SGLang server (GPU machines; run tests/rollout/gpu_sglang.sh).

SGLang has no CPU install from PyPI, so these tests run only where ``MEGARL_SGLANG_PYTHON`` names
the python of an SGLang venv; elsewhere they skip (the recorded-transcript tests in
test_sglang_replay.py cover the contract on every machine). With ``MEGARL_REQUIRE_SGLANG=1`` a
missing SGLang is a failure instead.
"""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
import torch

from megarl.rollout.embedded import teacher_forced_logprobs
from megarl.rollout.server_process import SGLangServerConfig, launch_sglang
from megarl.rollout.types import AuthError, BadRequestError, SamplingParams, WeightsDirError
from tests.rollout.conftest import PROMPT
from tests.rollout.hf_reference import hf_greedy, load_hf

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
LOGPROB_ATOL = 2e-2  # fp32 server vs fp32 recomputation, different GPU kernels


@pytest.fixture(scope="module")
def sglang_server(tiny_models, tmp_path_factory):
    python = os.environ.get("MEGARL_SGLANG_PYTHON")
    if not python:
        if os.environ.get("MEGARL_REQUIRE_SGLANG") == "1":
            pytest.fail("MEGARL_REQUIRE_SGLANG=1 but MEGARL_SGLANG_PYTHON is not set")
        pytest.skip("no SGLang here (set MEGARL_SGLANG_PYTHON on a GPU machine; see gpu_sglang.sh)")
    cfg = SGLangServerConfig(
        model_dir=str(tiny_models["v1"]),
        python=python,
        dtype="float32",
        work_dir=str(tmp_path_factory.mktemp("sglang")),
    )
    server = launch_sglang(cfg)
    yield server
    server.stop()


def run(coro):
    return asyncio.run(coro)


def test_live_generate_logprobs_reload_and_failures(sglang_server, tiny_models, tmp_path):
    v1, v2 = str(tiny_models["v1"]), str(tiny_models["v2"])

    async def go():
        async with sglang_server.client() as eng:
            r = await eng.generate(PROMPT, 4, SamplingParams(max_new_tokens=12, ignore_eos=True))
            assert len(r.samples) == 4
            model = load_hf(v1, "float32")
            for s in r.samples:
                ref = teacher_forced_logprobs(model, PROMPT, s.token_ids)
                assert (torch.tensor(s.logprobs) - ref).abs().max().item() < LOGPROB_ATOL
            g1 = (await eng.generate(PROMPT, 1, GREEDY)).samples[0]
            await eng.update_weights(v2, "v2")
            g2 = (await eng.generate(PROMPT, 1, GREEDY)).samples[0]
            await eng.update_weights(v1, "v1")
            g3 = (await eng.generate(PROMPT, 1, GREEDY)).samples[0]
            with pytest.raises(WeightsDirError, match="keeps the old weights"):
                await eng.update_weights(str(tmp_path / "missing"), check_dir=False)
            g4 = (await eng.generate(PROMPT, 1, GREEDY)).samples[0]
            # abort by id and pause(abort): HTTP 200 with partial output, finish_reason "abort"
            t = asyncio.ensure_future(
                eng.generate(
                    PROMPT, 1, SamplingParams(max_new_tokens=900, ignore_eos=True), request_id="live-abort"
                )
            )
            await asyncio.sleep(0.3)
            await eng.abort("live-abort")
            ab = (await t).samples[0]
            with pytest.raises(BadRequestError, match="outside the vocabulary"):
                await eng.generate([5, 1024, 5000])
            assert await eng.health()
            return g1, g2, g3, g4, ab

    g1, g2, g3, g4, ab = run(go())
    assert g1.token_ids == hf_greedy(v1, PROMPT, 16) == g3.token_ids == g4.token_ids
    assert g2.token_ids == hf_greedy(v2, PROMPT, 16) and g2.weight_version == "v2"
    assert ab.finish_reason == "abort" and len(ab.token_ids) < 900


def test_live_key_policy(sglang_server, tiny_models):
    keys = sglang_server.keys
    with httpx.Client(base_url=sglang_server.url, timeout=60) as c:
        gen = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        upd = {"model_path": str(tiny_models["v2"])}
        assert c.post("/generate", json=gen).status_code == 401
        assert c.post("/update_weights_from_disk", json=upd).status_code == 401
        api = {"Authorization": f"Bearer {keys.api_key}"}
        assert c.post("/update_weights_from_disk", json=upd, headers=api).status_code == 401
        assert c.post("/generate", json=gen, headers=api).status_code == 200
    cmdline = open(f"/proc/{sglang_server.proc.pid}/cmdline", "rb").read().decode()
    assert keys.api_key not in cmdline and keys.admin_key not in cmdline

    async def go():
        async with sglang_server.client(admin_key=keys.api_key) as eng:
            with pytest.raises(AuthError):
                await eng.pause()

    run(go())
