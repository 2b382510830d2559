"""Waiting for an embedded engine's request to be decoding, for tests that abort, kill or update
weights while a request is in flight: a condition on the batch instead of a fixed sleep, which a
fast machine outruns (the request has finished) and a loaded one undershoots (no token yet)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

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


class DecodeHold:
    """Stops an embedded engine's batch thread at the first decode step for which ``when()`` is
    true (``held`` is set then) until ``release()``, letting go of the engine lock while it waits
    (so a weight load can start draining and other threads can queue requests): the requests of
    that step stay in flight, a known number of tokens in, however fast the model decodes."""

    def __init__(self, engine: EmbeddedEngine, when: Callable[[], bool], timeout_s: float = 60.0):
        self.held, self._go_on = threading.Event(), threading.Event()
        held, go_on = self.held, self._go_on

        def hook(module, args, kw):
            if held.is_set() or kw["input_ids"].shape[1] != 1 or not when():
                return
            held.set()
            deadline = time.monotonic() + timeout_s
            while not go_on.is_set() and time.monotonic() < deadline:
                engine._lock.wait(0.005)  # the batch thread holds the engine lock during a step

        self._handle = engine.model.register_forward_pre_hook(hook, with_kwargs=True)

    def release(self) -> None:
        """Let the held step go on; no later step is held."""
        self._handle.remove()
        self._go_on.set()
