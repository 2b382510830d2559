"""Rank 0's side of the asynchronous loop: the rollout producer and what it needs.

- ``ThreadEventLoop``: an asyncio loop in a daemon thread; every engine call of an async run goes
  through it (the trainer's ``run_until_complete`` included).
- ``GatedEngine``: the engine as the run's rollout collector sees it in an async run: requests wait
  while a weight update is in progress, an aborted request is asked again (``partial_rollout:
  abort``) or continued from its prefix with the new weights (``continue``), and every sample
  carries the oldest policy version that generated it.
- ``RolloutProducer``: runs the collector (the same sample -> generate -> score -> shape -> filter as
  the synchronous loop) for each step on that loop, never more than ``max_staleness`` policy versions
  ahead of the learner, and hands finished batches to the trainer thread through a queue.

See megarl/trainer/async_loop.py for the versions, the bound and the update protocol.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import queue
import threading
import time
from collections.abc import Coroutine
from typing import Any

from megarl.rollout.engine import RolloutEngine, continue_from_prefix
from megarl.rollout.types import GenerateResult, Sample
from megarl.rollout.workflow import version_of
from megarl.trainer.rollouts import CollectedBatch


# ----------------------------------------------------------------------------------------- pieces
class ThreadEventLoop:
    """An asyncio event loop running forever in a daemon thread.

    ``run_until_complete(coro)`` (the interface ``Trainer`` uses for engine calls) runs ``coro`` on
    that loop from another thread and waits for it; ``submit`` returns a ``concurrent.futures.Future``.
    """

    def __init__(self, name: str = "megarl-rollout"):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Schedule ``coro`` on the thread's loop."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run_until_complete(self, coro: Coroutine) -> Any:
        """Run ``coro`` on the thread's loop and return its result (blocks the calling thread)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("run_until_complete called from the loop's own thread")
        return self.submit(coro).result()

    def close(self) -> None:
        """Cancel what is still running, stop the loop and join the thread."""
        if self._loop.is_closed():
            return

        async def cancel_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        try:
            self.submit(cancel_rest()).result(timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._loop.close()


def staleness_of(versions: list[int], train_version: int) -> list[int]:
    """Per-sample staleness: ``train_version - version`` (>= 0 for every sample a loop produces)."""
    return [train_version - v for v in versions]


def too_stale(group_versions: list[int], train_version: int, max_staleness: int) -> list[int]:
    """Indices of the groups whose (oldest) version lags ``train_version`` by more than ``max_staleness``."""
    return [i for i, v in enumerate(group_versions) if train_version - v > max_staleness]


class GatedEngine:
    """The engine behind the producer's gate (see the module docstring); other attributes are the
    engine's own (``model``, ``max_model_len``, ...)."""

    def __init__(self, engine: Any, partial: str, counters: dict, version: Any):
        self.inner, self.partial, self.counters, self._version = engine, partial, counters, version
        self.open = asyncio.Event()
        self.open.set()
        self.spanning: set[str] = set()  # request ids in flight across a kept (vLLM) weight update
        self._request_ids = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def _request(self, prompt_ids: list[int], n: int, sampling: Any) -> GenerateResult:
        """One engine request, started only while the gate is open; a request aborted before it
        produced any token is simply asked again (after the update)."""
        while True:
            await self.open.wait()
            self._request_ids += 1
            rid = f"megarl-async-{id(self):x}-{self._request_ids}"
            res = await self.inner.generate(prompt_ids, n=n, sampling=sampling, request_id=rid)
            res.request_id = rid
            if any(s.finish_reason != "abort" or s.token_ids for s in res.samples):
                return res
            self.counters["resubmitted_groups"] += 1

    async def generate(
        self,
        prompt_ids: list[int],
        n: int = 1,
        sampling: Any = None,
        request_id: str | None = None,
        **kw: Any,
    ) -> GenerateResult:
        """``n`` finished samples of ``prompt_ids``, each with ``weight_version`` = its oldest version
        and ``meta["mixed"]`` when it was generated across a weight update."""
        prompt_ids = list(prompt_ids)
        while True:
            res = await self._request(prompt_ids, n, sampling)
            kept = res.request_id in self.spanning  # generated across a kept update: old and new weights
            self.spanning.discard(res.request_id)
            for s in res.samples:
                v = version_of(s.weight_version)
                s.weight_version = str(self._version() if v is None else v)
                s.meta["mixed"] = kept
            if all(s.finish_reason != "abort" for s in res.samples):
                return res
            if self.partial == "abort":
                self.counters["resubmitted_groups"] += 1
                continue
            res.samples = list(
                await asyncio.gather(
                    *[self._continue(prompt_ids, s, sampling, j) for j, s in enumerate(res.samples)]
                )
            )
            return res

    async def _continue(self, prompt_ids: list[int], s: Sample, sp: Any, j: int) -> Sample:
        """Continue an aborted sample from its prefix (new weights) until it finishes
        (``continue_from_prefix`` through the gate: an empty prefix is a new request; integer
        versions, the oldest kept)."""
        while s.finish_reason == "abort":
            left = sp.max_new_tokens - len(s.token_ids)
            if left <= 0:
                s.finish_reason = "length"
                break
            self.counters["continued_samples"] += 1
            seed = None if sp.seed is None else (sp.seed * 31 + 7 * j + len(s.token_ids)) % (2**31)
            s = await continue_from_prefix(
                _GatedRequests(self),
                prompt_ids,
                s,
                dataclasses.replace(sp, max_new_tokens=left, seed=seed),
                allow_empty=True,
                version_order=int,
            )
        return s


class _GatedRequests:
    """One gated request per ``generate`` (``GatedEngine._request``: no continuation of its own),
    each sample labelled with its integer weight version."""

    def __init__(self, gated: GatedEngine):
        self.gated, self.name = gated, getattr(gated.inner, "name", "engine")

    async def generate(self, prompt_ids: list[int], n: int = 1, sampling: Any = None, request_id: Any = None):
        """The gated engine's answer to one request."""
        res = await self.gated._request(list(prompt_ids), n, sampling)
        for s in res.samples:
            v = version_of(s.weight_version)
            s.weight_version = str(self.gated._version() if v is None else v)
        return res


class RolloutProducer:
    """Generates the batches of steps ``first_step, first_step + 1, ...`` with ``collector`` on the
    thread loop, never more than ``max_staleness`` versions ahead of the learner; hands them over
    in ``batches``. Every coroutine here runs on the producer's loop; the trainer calls them through
    ``ThreadEventLoop.run_until_complete``. The sampler is touched only on that loop."""

    def __init__(
        self,
        engine: Any,
        sampler: Any,
        max_staleness: int,
        partial: str,
        total_steps: int,
        first_step: int,
        version: int,
        restored: list[CollectedBatch] | None = None,
        counters: dict | None = None,
    ):
        self.engine, self.sampler = engine, sampler
        self.max_staleness, self.partial, self.total_steps = max_staleness, partial, total_steps
        self.collector: Any = None
        self.batches: queue.Queue[CollectedBatch | BaseException] = queue.Queue()
        self._queued: list[CollectedBatch] = []  # mirror of the queue's batches (for checkpoints)
        for b in restored or []:
            self._put(b)
        self.next_step = first_step  # the step whose batch is generated now / next
        self.version = version
        self.counters = {
            "aborted_requests": 0,
            "resubmitted_groups": 0,
            "continued_samples": 0,
            "dropped_stale_groups": 0,
            "regenerated_groups": 0,
            "weight_updates": 0,
            "kept_requests": 0,
        }
        self.counters.update(counters or {})
        self.gated: GatedEngine | None = None
        self._sampler_at_batch_start: dict | None = None
        self._version_cond: asyncio.Condition | None = None
        self._task: asyncio.Task | None = None

    def gate(self, engine: Any) -> GatedEngine:
        """The gated view of ``engine`` the collector generates through (made on the producer loop)."""
        self.gated = GatedEngine(engine, self.partial, self.counters, lambda: self.version)
        return self.gated

    def _put(self, b: CollectedBatch) -> None:
        self._queued.append(b)
        self.batches.put(b)

    def take(self, step: int, timeout_s: float = 5.0) -> CollectedBatch:
        """Block (main thread) until the batch of ``step`` is ready; a producer failure is re-raised."""
        while True:
            try:
                item = self.batches.get(timeout=timeout_s)
            except queue.Empty:
                if self._task is not None and self._task.done() and self.batches.empty():
                    raise RuntimeError(
                        f"the rollout producer stopped without producing step {step}'s batch"
                    ) from None
                continue
            if isinstance(item, BaseException):
                raise RuntimeError(f"the rollout producer failed: {item!r}") from item
            self._queued.remove(item)
            if item.step != step:
                raise RuntimeError(f"rollout producer handed over step {item.step}'s batch at step {step}")
            return item

    # ------------------------------------------------------------------- control (producer loop)
    async def start(self) -> None:
        """Start producing (on the producer loop)."""
        self._version_cond = asyncio.Condition()
        self._task = asyncio.get_running_loop().create_task(self._main())

    async def before_update(self) -> None:
        """Close the gate, hold new requests in the engine client and abort the ones in flight."""
        self.gated.open.clear()
        # the base class's client-side pause only (a server-side pause is the weight update's business)
        await RolloutEngine.pause(self.engine)
        self.counters["aborted_requests"] += await self.engine.abort()

    async def after_update(self, version: int) -> None:
        """The engine serves ``version`` now: release held requests and the gate."""
        await RolloutEngine.resume(self.engine)
        self.counters["weight_updates"] += 1
        async with self._version_cond:
            self.version = version
            self._version_cond.notify_all()
        self.gated.open.set()

    async def update_keeping(self, weights_dir: str, version: int) -> None:
        """vLLM, ``partial_rollout: continue``: the server keeps its requests frozen across the reload
        of ``weights_dir`` (they finish with the new weights); then ``version`` is served."""
        self.gated.open.clear()

        def frozen(request_ids: list[str]) -> None:  # generated across the update: old and new weights
            self.gated.spanning.update(request_ids)
            self.counters["kept_requests"] += len(request_ids)

        await self.engine.update_weights_keeping_requests(weights_dir, str(version), frozen)
        await self.after_update(version)

    async def stop(self) -> None:
        """Stop producing and abort what is in flight."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await self.engine.abort()
            await asyncio.gather(self._task, return_exceptions=True)

    async def snapshot(self) -> dict:
        """The producer's state for a checkpoint (on the loop, so the sampler is not moving)."""
        from megarl.trainer.rollouts import batch_to_json

        sampler = self._sampler_at_batch_start or self.sampler.state_dict()
        return {
            "queued": [batch_to_json(b) for b in self._queued],
            "next_step": self.next_step,
            "sampler": sampler,
            "counters": dict(self.counters),
            "version": self.version,
            "max_staleness": self.max_staleness,
        }

    # ------------------------------------------------------------------- production
    async def _main(self) -> None:
        try:
            while self.next_step <= self.total_steps:
                s = self.next_step
                async with self._version_cond:
                    await self._version_cond.wait_for(lambda s=s: self.version >= s - 1 - self.max_staleness)
                self._sampler_at_batch_start = self.sampler.state_dict()
                t0 = time.time()
                b = await self.collector.collect(s)
                b.stats["gen_time"] = time.time() - t0 - b.stats["reward_time"]
                self.next_step = s + 1
                self._sampler_at_batch_start = None
                self._put(b)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.batches.put(e)
