"""``rollout.weight_sync``: auto resolves to memory only for a server the run launches (vLLM or
SGLang), memory is accepted for vLLM and SGLang servers, and refused where it cannot work, naming
the keys; ``rollout.launch`` and ``rollout.server_device`` are refused where they cannot apply."""

from __future__ import annotations

import pytest

from megarl.trainer.config import ConfigError, load_config
from megarl.trainer.weights import weight_sync_mode

QUICKSTART = "examples/quickstart.yaml"


@pytest.mark.parametrize(
    "overrides, mode",
    [
        ([], "disk"),  # embedded: its own in-process path; no server sync
        (["rollout.engine=vllm", "rollout.launch=true"], "memory"),
        (["rollout.engine=vllm", "rollout.urls=[http://h:8000]"], "disk"),
        (["rollout.engine=vllm", "rollout.urls=[http://h:8000]", "rollout.weight_sync=memory"], "memory"),
        (["rollout.engine=vllm", "rollout.launch=true", "rollout.weight_sync=disk"], "disk"),
        (["rollout.engine=sglang", "rollout.urls=[http://h:30000]"], "disk"),
        (["rollout.engine=sglang", "rollout.launch=true", "rollout.server_device=cpu"], "memory"),
        (["rollout.engine=sglang", "rollout.urls=[http://h:30000]", "rollout.weight_sync=memory"], "memory"),
    ],
)
def test_auto_is_memory_only_for_a_launched_server(overrides, mode):
    assert weight_sync_mode(load_config(QUICKSTART, overrides).rollout) == mode


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rollout.weight_sync=memory"],
            "rollout.weight_sync='memory' sends weights to vLLM or SGLang servers; rollout.engine='embedded'",
        ),
        (["rollout.launch=true"], "rollout.launch=true starts one vLLM or SGLang server"),
        (
            ["rollout.engine=vllm", "rollout.launch=true", "rollout.server_device=cpu"],
            "rollout.server_device is for a launched SGLang server",
        ),
        (
            [
                "rollout.engine=vllm",
                "rollout.launch=true",
                "rollout.weight_sync=memory",
                "async_loop.enabled=true",
                "async_loop.partial_rollout=continue",
            ],
            "partial_rollout='continue'",
        ),
    ],
)
def test_memory_is_refused_where_it_cannot_work(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_config(QUICKSTART, overrides)
