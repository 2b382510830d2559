"""The rollout engine interface: async, token-in/token-out, bounded concurrency with backpressure.

Every engine (vLLM client, SGLang client, embedded in-process model) implements ``_generate``
and the control methods; this base class adds what they share: client-side validation of the
prompt ids, a concurrency bound (callers above the bound wait: that is the backpressure), a
pause gate, abort of in-flight requests and the weight-version label stamped on each sample.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any

from megarl.rollout.types import (
    BadRequestError,
    GenerateRequest,
    GenerateResult,
    Sample,
    SamplingParams,
    validate_prompt_ids,
)

_request_counter = itertools.count()


class RolloutEngine(abc.ABC):
    """Base of every engine.

    Args:
      name: shown in every error and result (e.g. ``vllm@127.0.0.1:8000``).
      max_concurrency: requests in flight at once; further ``generate`` calls wait for a slot.
      vocab_size / max_model_len: client-side limits checked before anything is sent.
    """

    def __init__(
        self,
        name: str,
        max_concurrency: int = 32,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
        weight_version: str = "0",
    ):
        if max_concurrency < 1:
            raise ValueError(f"{name}: max_concurrency must be >= 1, got {max_concurrency}")
        self.name = name
        self.max_concurrency = max_concurrency
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.weight_version = weight_version
        self._slots = asyncio.Semaphore(max_concurrency)
        self._not_paused = asyncio.Event()
        self._not_paused.set()
        self._waiting = 0
        self._inflight: dict[str, asyncio.Task] = {}
        self._aborted: set[str] = set()

    # ----------------------------------------------------------------------------- generation
    @property
    def outstanding(self) -> int:
        """Requests waiting for a slot plus requests in flight (used for load balancing)."""
        return self._waiting + len(self._inflight)

    async def generate(
        self,
        prompt_ids: Sequence[int],
        n: int = 1,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        return_routed_experts: bool = False,
    ) -> GenerateResult:
        """Generate ``n`` samples for one prompt of token ids.

        Returns one ``Sample`` per sample with token ids, per-token logprobs, finish reason
        ("stop" | "length" | "abort") and the weight version. Raises ``BadRequestError`` for bad
        input (checked here before sending), ``EngineDeadError`` / ``EngineUnavailableError`` when
        the engine cannot serve.
        """
        sampling = (sampling or SamplingParams()).validate()
        if n < 1:
            raise BadRequestError(f"{self.name}: n must be >= 1, got {n}")
        ids = validate_prompt_ids(
            prompt_ids, self.vocab_size, self.name, self.max_model_len, sampling.max_new_tokens
        )
        rid = request_id or f"megarl-{os.getpid()}-{next(_request_counter)}"
        req = GenerateRequest(
            prompt_ids=ids,
            n=n,
            sampling=sampling,
            request_id=rid,
            return_routed_experts=return_routed_experts,
        )
        self._waiting += 1
        try:
            await self._not_paused.wait()
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        try:
            await self._not_paused.wait()
            version = self.weight_version
            task = asyncio.ensure_future(self._generate(req))
            self._inflight[rid] = task
            try:
                result = await task
            except asyncio.CancelledError:
                if rid in self._aborted and task.cancelled():
                    return self._aborted_result(req)
                raise
            for s in result.samples:
                if s.weight_version is None:
                    s.weight_version = version
            return result
        finally:
            self._inflight.pop(rid, None)
            self._aborted.discard(rid)
            self._slots.release()

    async def continue_sample(
        self,
        prompt_ids: Sequence[int],
        prefix: Sample,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> Sample:
        """``prefix`` continued to the end on this engine (``continue_from_prefix``)."""
        return await continue_from_prefix(self, prompt_ids, prefix, sampling, request_id)

    def _aborted_result(self, req: GenerateRequest) -> GenerateResult:
        return GenerateResult(
            prompt_ids=list(req.prompt_ids),
            request_id=req.request_id,
            engine=self.name,
            samples=[
                Sample(token_ids=[], logprobs=[], finish_reason="abort", weight_version=self.weight_version)
                for _ in range(req.n)
            ],
        )

    @abc.abstractmethod
    async def _generate(self, req: GenerateRequest) -> GenerateResult:
        """Engine-specific generation of one validated request."""

    async def score_tokens(self, token_ids: Sequence[int], top_k: int = 0):
        """Teacher-forced scores of ``token_ids`` (a ``megarl.rollout.scoring.TokenScores``): the
        logprob of every token given its prefix and, with ``top_k`` > 0, the K best alternatives
        per position. Waits for a slot like ``generate``; engines that cannot score refuse."""
        if top_k < 0:
            raise BadRequestError(f"{self.name}: top_k must be >= 0, got {top_k}")
        ids = validate_prompt_ids(token_ids, self.vocab_size, self.name, self.max_model_len, 1)
        self._waiting += 1
        try:
            await self._not_paused.wait()
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        try:
            return await self._score(ids, top_k)
        finally:
            self._slots.release()

    async def _score(self, ids: list[int], top_k: int):
        raise BadRequestError(f"{self.name}: this engine cannot score given tokens (score_tokens)")

    # ----------------------------------------------------------------------------- control
    async def abort(self, request_id: str | None = None) -> int:
        """Abort one in-flight request (or all with ``None``); their callers get finish_reason "abort".

        Returns how many requests were aborted. The default cancels the HTTP call (servers abort
        a request whose client disconnects); engines with an abort route override this.
        """
        ids = [request_id] if request_id is not None else list(self._inflight)
        count = 0
        for rid in ids:
            task = self._inflight.get(rid)
            if task is not None and not task.done():
                self._aborted.add(rid)
                task.cancel()
                count += 1
        return count

    async def pause(self) -> None:
        """Stop starting new requests (callers wait) and let the engine drain the in-flight ones."""
        self._not_paused.clear()

    async def resume(self) -> None:
        """Start serving queued requests again."""
        self._not_paused.set()

    @property
    def paused(self) -> bool:
        return not self._not_paused.is_set()

    @abc.abstractmethod
    async def update_weights(self, weights_dir: str | os.PathLike, version: str | None = None) -> None:
        """Load new weights from a HF checkpoint directory; later samples carry ``version``."""

    @abc.abstractmethod
    async def health(self) -> bool:
        """True when the engine can serve a request now."""

    async def close(self) -> None:  # noqa: B027 (a no-op by default, not abstract: most engines hold nothing)
        """Release client resources (not the server)."""

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, version={self.weight_version!r})"


async def continue_from_prefix(
    engine: Any,
    prompt_ids: Sequence[int],
    prefix: Sample,
    sampling: SamplingParams | None = None,
    request_id: str | None = None,
    *,
    allow_empty: bool = False,
    version_order: Callable[[str], Any] | None = None,
) -> Sample:
    """``prefix`` (a sample of ``prompt_ids`` that stopped at its length limit, or was aborted)
    continued to the end through ``engine.generate`` (any engine, or a wrapper of one): one request
    whose prompt is ``prompt_ids + prefix.token_ids`` (re-prefilled, never re-sampled), for at most
    ``sampling.max_new_tokens`` more tokens, joined to the prefix by ``join_continuation``. An
    empty prefix is refused unless ``allow_empty`` (then the request is a plain new one)."""
    name = getattr(engine, "name", "engine")
    if len(prefix.token_ids) != len(prefix.logprobs):
        raise BadRequestError(
            f"{name}: prefix has {len(prefix.token_ids)} tokens and {len(prefix.logprobs)} logprobs"
        )
    if not prefix.token_ids and not allow_empty:
        raise BadRequestError(f"{name}: a continuation needs a prefix of at least one token")
    res = await engine.generate(
        list(prompt_ids) + list(prefix.token_ids), n=1, sampling=sampling, request_id=request_id
    )
    return join_continuation(prefix, res.samples[0], version_order)


def join_continuation(
    prefix: Sample, tail: Sample, version_order: Callable[[str], Any] | None = None
) -> Sample:
    """One sample: ``prefix``'s tokens and logprobs, unchanged, followed by ``tail``'s (its
    continuation); finish reason, stop reason and routed experts (over the whole sequence) are the
    tail's. When the two parts carry different weight versions the sample keeps the older: the
    smaller under ``version_order`` when given (e.g. ``int`` for integer labels), else the
    prefix's (generated first). ``meta["mixed"]``: a non-empty prefix and a tail of different
    versions, or either part already mixed."""
    pv, tv = prefix.weight_version, tail.weight_version
    differ = pv is not None and tv != pv
    if version_order is not None and pv is not None and tv is not None:
        version = min(pv, tv, key=version_order)
    else:
        version = pv if differ else tv
    mixed = (differ and bool(prefix.token_ids)) or bool(tail.meta.get("mixed") or prefix.meta.get("mixed"))
    return Sample(
        token_ids=list(prefix.token_ids) + list(tail.token_ids),
        logprobs=list(prefix.logprobs) + list(tail.logprobs),
        finish_reason=tail.finish_reason,
        weight_version=version,
        stop_reason=tail.stop_reason,
        routed_experts=tail.routed_experts,
        meta={**tail.meta, "mixed": mixed},
    )
