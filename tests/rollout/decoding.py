"""Waiting for an embedded engine's request to be decoding, for tests that abort, kill or update
weights while a request is in flight: a condition on the batch instead of a fixed sleep, which a
fast machine outruns (the request has finished) and a loaded one undershoots (no token yet)."""

from __future__ import annotations

import asyncio
import time

from megarl.rollout.embedded import EmbeddedEngine


def tokens_sampled(engine: EmbeddedEngine, request_id: str | None = None) -> int:
    """Decode steps done so far by ``request_id`` (by the furthest request with None) in the
    engine's batch; 0 when it is not decoding."""
    steps = [
        job.steps
        for job in list(engine._batcher.active)
        if request_id is None or job.req.request_id == request_id
    ]
    return max(steps, default=0)


async def until_decoding(
    engine: EmbeddedEngine, request_id: str | None = None, tokens: int = 1, timeout_s: float = 60.0
) -> None:
    """Return once ``request_id`` (any request with None) has sampled ``tokens`` tokens."""
    deadline = time.monotonic() + timeout_s
    while tokens_sampled(engine, request_id) < tokens:
        assert time.monotonic() < deadline, (
            f"{engine.name}: {request_id or 'nothing'} decoding after {timeout_s} s"
        )
        await asyncio.sleep(0.002)
