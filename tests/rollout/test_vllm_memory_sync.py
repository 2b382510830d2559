"""In-memory weight sync to a real vLLM server: the HF-named tensors go over a gloo channel to the
server's workers and are reloaded in place, no checkpoint on disk."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from megarl.rollout.types import SamplingParams, WeightsDirError
from tests.rollout.conftest import PROMPT
from tests.rollout.hf_reference import hf_greedy

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _state(model_dir) -> dict[str, torch.Tensor]:
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
            bad = dict(_state(v2))
            bad["model.layers.0.mlp.extra.weight"] = bad.pop("model.norm.weight")
            with pytest.raises(WeightsDirError, match=r"missing \['model.norm.weight'\].*unknown"):
                await eng.update_weights_from_tensors(bad, version="x")
            await eng.update_weights_from_tensors(_state(v2), version="m2")
            s2 = (await eng.generate(PROMPT, sampling=greedy)).samples[0]
            await eng.update_weights_from_tensors(_state(v1), version="m3")
            s3 = (await eng.generate(PROMPT, sampling=greedy)).samples[0]
            return s2, s3, await eng.server_weight_version()

    s2, s3, version = asyncio.run(go())
    assert s2.token_ids == ref2 and s2.weight_version == "m2"
    assert s3.token_ids == ref1 and version == "m3"
