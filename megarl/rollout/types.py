"""Requests, results and errors shared by every rollout engine (token-in, token-out)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


class RolloutError(RuntimeError):
    """Base class of every rollout engine error; the message names the engine and the request."""


class BadRequestError(RolloutError):
    """The request itself is wrong (token id out of vocab, too long, bad parameter); retrying elsewhere
    will not help."""


class EngineDeadError(RolloutError):
    """The engine cannot serve any more (connection refused, engine crashed, failed weight reload)."""


class EngineUnavailableError(RolloutError):
    """The engine answered but cannot serve right now (paused, overloaded, transient 5xx)."""


class AuthError(RolloutError):
    """The engine refused the credentials (HTTP 401/403)."""


class NoHealthyEngineError(RolloutError):
    """Every engine of a pool is down; the run cannot go on."""


class WeightsDirError(RolloutError):
    """A weights directory is incomplete, unreadable or does not match the served model."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy. ``seed`` makes sampling reproducible on
    engines that honour it (vLLM, embedded; SGLang only with --enable-deterministic-inference)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def validate(self) -> SamplingParams:
        """Raise ``BadRequestError`` naming the bad field."""
        if self.temperature < 0:
            raise BadRequestError(f"sampling param 'temperature' must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise BadRequestError(f"sampling param 'top_p' must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise BadRequestError(f"sampling param 'top_k' must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise BadRequestError(f"sampling param 'max_new_tokens' must be >= 1, got {self.max_new_tokens}")
        return self


@dataclass
class GenerateRequest:
    """One prompt, ``n`` samples. ``prompt_ids`` are token ids (never text)."""

    prompt_ids: Sequence[int]
    n: int = 1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    return_routed_experts: bool = False


@dataclass
class Sample:
    """One generated continuation.

    ``token_ids``: [R] generated ids (a matched stop token is included, as both servers do);
    ``logprobs``: [R] log p(token_ids[i] | prompt, token_ids[:i]) under the sampling distribution's
    model (temperature not applied); ``finish_reason``: "stop" | "length" | "abort";
    ``weight_version``: the policy version that generated it; ``routed_experts``: [P+R, layers, topk]
    when the engine returns it, else None.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: str | None = None
    stop_reason: object | None = None
    routed_experts: list | None = None
    meta: dict = field(default_factory=dict)  # engine-specific extras (e.g. SGLang input logprobs)


@dataclass
class GenerateResult:
    """The ``n`` samples for one request plus where they came from."""

    prompt_ids: list[int]
    samples: list[Sample]
    engine: str = ""
    request_id: str | None = None


def validate_prompt_ids(
    prompt_ids: Sequence[int],
    vocab_size: int | None,
    engine: str = "engine",
    max_model_len: int | None = None,
    max_new_tokens: int | None = None,
) -> list[int]:
    """Check prompt ids client-side before sending (SGLang crashes on an out-of-vocab id).

    Returns the ids as a plain list; raises ``BadRequestError`` naming the first bad position.
    """
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise BadRequestError(f"{engine}: the prompt has no token")
    for i, t in enumerate(ids):
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise BadRequestError(
                f"{engine}: prompt token {i} has id {t}, outside the vocabulary [0, {vocab_size})"
            )
    if max_model_len is not None:
        if len(ids) >= max_model_len:
            raise BadRequestError(
                f"{engine}: prompt of {len(ids)} tokens leaves no room in max_model_len={max_model_len}"
            )
        if max_new_tokens is not None and len(ids) + max_new_tokens > max_model_len:
            raise BadRequestError(
                f"{engine}: prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                f"max_model_len={max_model_len}"
            )
    return ids


def check_weight_sync_backend(value: str | None) -> str | None:
    """A client's ``weight_sync_backend`` argument, checked: None (follow the server's device),
    "gloo" or "nccl"."""
    if value not in (None, "gloo", "nccl"):
        raise ValueError(f"weight_sync_backend must be None, 'gloo' or 'nccl', got {value!r}")
    return value
