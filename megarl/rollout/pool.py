"""A pool of engines behind the one engine interface: least-outstanding-requests balancing,
dead engines marked down, bounded retry elsewhere, a clear error when none is left."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from megarl.rollout.engine import RolloutEngine
from megarl.rollout.types import (
    EngineDeadError,
    EngineUnavailableError,
    GenerateRequest,
    GenerateResult,
    NoHealthyEngineError,
    RolloutError,
    SamplingParams,
)

log = logging.getLogger(__name__)


class PartialRolloutError(RolloutError):
    """Some requests of a batch could not be served. ``results[i]`` is the finished result of
    request i (``None`` for the failed ones), so nothing already generated is lost."""

    def __init__(self, message: str, results: list[GenerateResult | None], errors: dict[int, BaseException]):
        super().__init__(message)
        self.results, self.errors = results, errors


@dataclass
class BatchItem:
    """One prompt of a batch for ``EnginePool.generate_batch``."""

    prompt_ids: Sequence[int]
    n: int = 1
    sampling: SamplingParams | None = None
    request_id: str | None = None


@dataclass
class _Member:
    engine: RolloutEngine
    down_reason: str | None = None
    served: int = 0
    failures: list[str] = field(default_factory=list)


class EnginePool(RolloutEngine):
    """Route each request to the up engine with the fewest outstanding requests.

    An engine that fails with ``EngineDeadError`` is marked down for good; ``EngineUnavailableError``
    (timeout, 503) is retried elsewhere without marking it down. A request is tried on at most
    ``max_attempts`` engines; when no engine is up, ``NoHealthyEngineError`` names every engine and
    why it went down. Bad requests (``BadRequestError``) are not retried.
    """

    def __init__(self, engines: Sequence[RolloutEngine], *, name: str = "pool", max_attempts: int = 3):
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        vocab = [e.vocab_size for e in engines if e.vocab_size is not None]
        lens = [e.max_model_len for e in engines if e.max_model_len is not None]
        super().__init__(
            name,
            max_concurrency=sum(e.max_concurrency for e in engines),
            vocab_size=min(vocab) if vocab else None,
            max_model_len=min(lens) if lens else None,
            weight_version=engines[0].weight_version,
        )
        self.members = [_Member(e) for e in engines]
        self.max_attempts = max_attempts

    @property
    def up(self) -> list[RolloutEngine]:
        return [m.engine for m in self.members if m.down_reason is None]

    def mark_down(self, engine: RolloutEngine, reason: str) -> None:
        """Take ``engine`` out of rotation (it is not used again)."""
        for m in self.members:
            if m.engine is engine and m.down_reason is None:
                m.down_reason = reason
                log.warning("rollout pool: %s marked down: %s", engine.name, reason)

    def _pick(self, exclude: set[int]) -> _Member | None:
        cands = [m for m in self.members if m.down_reason is None and id(m.engine) not in exclude]
        if not cands:
            cands = [m for m in self.members if m.down_reason is None]
        return min(cands, key=lambda m: m.engine.outstanding) if cands else None

    def _none_left(self) -> NoHealthyEngineError:
        why = "; ".join(f"{m.engine.name}: {m.down_reason}" for m in self.members)
        return NoHealthyEngineError(f"{self.name}: no rollout engine is up ({why})")

    async def _generate(self, req: GenerateRequest) -> GenerateResult:
        tried: set[int] = set()
        last: BaseException | None = None
        for attempt in range(self.max_attempts):
            m = self._pick(tried)
            if m is None:
                raise self._none_left() from last
            tried.add(id(m.engine))
            rid = req.request_id if attempt == 0 else f"{req.request_id}-retry{attempt}"
            try:
                res = await m.engine.generate(
                    req.prompt_ids,
                    req.n,
                    req.sampling,
                    request_id=rid,
                    return_routed_experts=req.return_routed_experts,
                )
            except EngineDeadError as e:
                self.mark_down(m.engine, str(e))
                m.failures.append(str(e))
                last = e
                continue
            except EngineUnavailableError as e:
                m.failures.append(str(e))
                last = e
                continue
            m.served += 1
            return res
        if not self.up:
            raise self._none_left() from last
        raise RolloutError(
            f"{self.name}: request {req.request_id} failed on {len(tried)} engine(s) after "
            f"{self.max_attempts} attempts; last error: {last}"
        ) from last

    async def generate_batch(self, items: Sequence[BatchItem]) -> list[GenerateResult]:
        """Generate every item concurrently; raise ``PartialRolloutError`` (keeping the finished
        results) if any item failed everywhere."""
        outs = await asyncio.gather(
            *(self.generate(it.prompt_ids, it.n, it.sampling, request_id=it.request_id) for it in items),
            return_exceptions=True,
        )
        errors = {i: o for i, o in enumerate(outs) if isinstance(o, BaseException)}
        results = [None if isinstance(o, BaseException) else o for o in outs]
        if errors:
            first = next(iter(errors.values()))
            raise PartialRolloutError(
                f"{self.name}: {len(errors)} of {len(items)} requests failed "
                f"({len(items) - len(errors)} finished results kept); first error: {first}",
                results,
                errors,
            )
        return results  # type: ignore[return-value]

    # ----------------------------------------------------------------------------- control
    async def update_weights(self, weights_dir: str | os.PathLike, version: str | None = None) -> None:
        """Reload every up engine concurrently; an engine that fails the reload is marked down."""
        ups = [m for m in self.members if m.down_reason is None]
        outs = await asyncio.gather(
            *(m.engine.update_weights(weights_dir, version) for m in ups), return_exceptions=True
        )
        first_err = None
        for m, o in zip(ups, outs):
            if isinstance(o, EngineDeadError):
                self.mark_down(m.engine, f"weight reload failed: {o}")
            elif isinstance(o, BaseException):
                first_err = first_err or o  # e.g. WeightsDirError: nothing was sent, engines untouched
        if first_err is not None:
            raise first_err
        if not self.up:
            raise self._none_left()
        if version is not None:
            self.weight_version = version

    async def update_weights_from_tensors(self, state: dict, version: str | None = None) -> None:
        """Send in-memory weights to every up engine; see ``update_weights_streamed``."""
        from megarl.rollout.memory_sync import plan_buckets

        await self.update_weights_streamed(list(state), plan_buckets(state), version)

    async def update_weights_streamed(self, names: list, buckets, version: str | None = None) -> None:
        """Stream weights to every up engine, one after another (each has its own channel; with
        more than one the buckets are held so that each engine gets them all); an engine that fails
        the sync is marked down."""
        ups = [m for m in self.members if m.down_reason is None]
        if len(ups) > 1:
            buckets = list(buckets)
        first_err = None
        for m in ups:
            try:
                await m.engine.update_weights_streamed(names, buckets, version)
            except EngineDeadError as e:
                self.mark_down(m.engine, f"in-memory weight sync failed: {e}")
            except Exception as e:  # e.g. WeightsDirError: nothing was sent, the engine untouched
                first_err = first_err or e
        if first_err is not None:
            raise first_err
        if not self.up:
            raise self._none_left()
        if version is not None:
            self.weight_version = version

    async def pause(self) -> None:
        await super().pause()
        await asyncio.gather(*(e.pause() for e in self.up), return_exceptions=True)

    async def resume(self) -> None:
        await asyncio.gather(*(e.resume() for e in self.up), return_exceptions=True)
        await super().resume()

    async def abort(self, request_id: str | None = None) -> int:
        counts = await asyncio.gather(*(e.abort(request_id) for e in self.up), return_exceptions=True)
        return sum(c for c in counts if isinstance(c, int))

    async def health(self) -> bool:
        """Probe every up engine, mark the unhealthy ones down; True while one is left."""
        ups = self.up
        oks = await asyncio.gather(*(e.health() for e in ups))
        for e, ok in zip(ups, oks):
            if not ok:
                self.mark_down(e, "health check failed")
        return bool(self.up)

    async def close(self) -> None:
        await asyncio.gather(*(m.engine.close() for m in self.members), return_exceptions=True)
