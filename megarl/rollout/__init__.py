"""Rollout engines behind one async, token-in/token-out interface.

- ``engine.RolloutEngine``: the interface (generate / update_weights / pause / resume / abort / health).
- ``vllm_client.VLLMEngine`` + ``launcher.launch_vllm``: a real vLLM server in its own venv.
- ``sglang_client.SGLangEngine``: SGLang's native /generate API.
- ``embedded.EmbeddedEngine``: in-process HF model; the default when no server is configured.
- ``pool.EnginePool``: several engines, least-outstanding balancing, retry, dead-engine handling.
- ``environments``: multi-turn environments and the episode -> PackedBatch conversion.
- ``auth_proxy`` / ``keys``: per-job keys and the authenticating forwarder in front of vLLM.
"""

from megarl.rollout.engine import RolloutEngine
from megarl.rollout.types import (
    AuthError,
    BadRequestError,
    EngineDeadError,
    EngineUnavailableError,
    GenerateResult,
    NoHealthyEngineError,
    RolloutError,
    Sample,
    SamplingParams,
    WeightsDirError,
)

__all__ = [
    "AuthError",
    "BadRequestError",
    "EngineDeadError",
    "EngineUnavailableError",
    "GenerateResult",
    "NoHealthyEngineError",
    "RolloutEngine",
    "RolloutError",
    "Sample",
    "SamplingParams",
    "WeightsDirError",
    "make_engine",
]


def make_engine(
    server_urls: list[str] | None = None,
    *,
    model_dir: str | None = None,
    kind: str = "vllm",
    model: str = "policy",
    **kw,
) -> RolloutEngine:
    """The engine a run uses: a pool over ``server_urls`` (``kind`` "vllm" or "sglang"), or the
    embedded engine on ``model_dir`` when no server is configured."""
    if not server_urls:
        if model_dir is None:
            raise ValueError("make_engine: no server configured and no model_dir for the embedded engine")
        from megarl.rollout.embedded import EmbeddedEngine

        return EmbeddedEngine.from_pretrained(model_dir, **kw)
    from megarl.rollout.pool import EnginePool

    if kind == "vllm":
        from megarl.rollout.vllm_client import VLLMEngine

        engines = [VLLMEngine(u, model, **kw) for u in server_urls]
    elif kind == "sglang":
        from megarl.rollout.sglang_client import SGLangEngine

        engines = [SGLangEngine(u, **kw) for u in server_urls]
    else:
        raise ValueError(f"make_engine: unknown engine kind {kind!r} (expected 'vllm' or 'sglang')")
    return engines[0] if len(engines) == 1 else EnginePool(engines)
