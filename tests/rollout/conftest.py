"""Rollout test fixtures: tiny random Qwen3 checkpoints and ONE real vLLM server per session.

Tests marked ``vllm`` need the vLLM venv made by tests/setup/20-vllm.sh. When it is missing they
FAIL in CI (``CI=true``), so a broken setup cannot hide behind skips; on a developer machine they
skip.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from megarl.rollout.server_process import VLLMServerConfig, launch_vllm
from megarl.testing.tiny_qwen3 import build_tiny_qwen3
from tests.vllm_venv import require_vllm_python

PROMPT = [586, 28, 594, 289, 370, 13, 20, 33, 201, 591, 28]  # "user: What is 2+2?\nassistant:"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Two weight sets of the same tiny Qwen3 (v1: seed 0, v2: seed 1), saved in bf16."""
    root = tmp_path_factory.mktemp("tiny-qwen3")
    return {"v1": build_tiny_qwen3(root / "v1", seed=0), "v2": build_tiny_qwen3(root / "v2", seed=1)}


@pytest.fixture(scope="session")
def vllm_server(tiny_models, tmp_path_factory):
    """One real vLLM server on the v1 weights, bound to loopback, reachable through the
    authenticating forwarder (which listens on another port, as it would on the node address).

    fp32 so that greedy decoding can be compared with transformers token for token: in bf16 the
    eager CPU kernels flip a near-tied argmax of this random model (measured: token 8 of 16).
    """
    python = require_vllm_python()
    work = tmp_path_factory.mktemp("vllm-server")
    cfg = VLLMServerConfig(
        model_dir=str(tiny_models["v1"]),
        python=python,
        served_model_name="tiny",
        expose_host="127.0.0.1",
        work_dir=str(work),
        max_num_seqs=32,
        dtype="float32",
        startup_timeout_s=600,
    )
    t0 = time.monotonic()
    server = launch_vllm(cfg)
    print(f"\nvLLM server healthy after {time.monotonic() - t0:.1f} s")
    yield server
    server.stop()
