"""Rank 0's side of the asynchronous loop: the rollout producer and what it needs.

- ``ThreadEventLoop``: an asyncio loop in a daemon thread; every engine call of an async run goes
  through it (the trainer's ``run_until_complete`` included).
- ``RolloutProducer``: builds the batch of each step on that loop, never more than
  ``max_staleness`` policy versions ahead of the learner, applies the partial-rollout policy at
  weight updates, and hands finished batches to the trainer thread through a queue.
- ``SampleRecord`` / ``GroupRecord`` / ``ProducedBatch``: finished samples with their policy version,
  and their JSON form for checkpoints.

See megarl/trainer/async_loop.py for the versions, the bound and the update protocol.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megarl.data.dataset import PromptRow
from megarl.rollout.engine import RolloutEngine

if TYPE_CHECKING:
    from megarl.trainer.async_loop import AsyncTrainer


def _log(msg: str) -> None:
    print(msg, flush=True)  # the producer lives on rank 0 only


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


class LockedRewards:
    """A ``RewardComputer`` shared by the producer thread and the main thread (evaluation): one call
    at a time (contained reward functions talk to one worker process over a pipe)."""

    def __init__(self, inner):
        self.inner = inner
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        return self.inner.names

    def __call__(self, responses: list[str], answers: list[str]):
        with self._lock:
            return self.inner(responses, answers)

    def close(self) -> None:
        with self._lock:
            self.inner.close()


@dataclass
class SampleRecord:
    """One finished sample: ``token_ids``/``logprobs`` [R]; ``version``: the oldest version that
    generated any of its tokens; ``mixed``: continued across a weight update."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int
    mixed: bool = False


@dataclass
class GroupRecord:
    """The ``n`` samples of one prompt with their rewards."""

    row: PromptRow
    prompt_ids: list[int]
    samples: list[SampleRecord]
    rewards: list[float] = field(default_factory=list)
    reward_dims: dict[str, list[float]] = field(default_factory=dict)
    texts: list[str] = field(default_factory=list)
    rnd: int = 0
    index: int = 0

    @property
    def version(self) -> int:
        """The group's oldest sample version (what the staleness bound is checked on)."""
        return min(s.version for s in self.samples)


@dataclass
class ProducedBatch:
    """The groups of one step as the producer made them, plus its rollout statistics."""

    step: int
    groups: list[GroupRecord]
    stats: dict


def staleness_of(versions: list[int], train_version: int) -> list[int]:
    """Per-sample staleness: ``train_version - version`` (>= 0 for every sample a loop produces)."""
    return [train_version - v for v in versions]


def too_stale(group_versions: list[int], train_version: int, max_staleness: int) -> list[int]:
    """Indices of the groups whose (oldest) version lags ``train_version`` by more than ``max_staleness``."""
    return [i for i, v in enumerate(group_versions) if train_version - v > max_staleness]


def _version_of(label: str | None, fallback: int) -> int:
    try:
        return int(label)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return fallback


# ----------------------------------------------------------------------------------------- producer
class RolloutProducer:
    """Generates the batches of steps ``first_step, first_step + 1, ...`` on the thread loop, never
    more than ``max_staleness`` versions ahead of the learner; hands them over in ``batches``.

    Every coroutine here runs on the producer's loop; the trainer calls them through
    ``ThreadEventLoop.run_until_complete``. The sampler is touched only on that loop.
    """

    def __init__(self, trainer: AsyncTrainer, first_step: int, version: int,
                 restored: list[ProducedBatch] | None = None, counters: dict | None = None):
        self.t = trainer
        a = trainer.cfg.async_loop
        self.max_staleness, self.partial = a.max_staleness, a.partial_rollout
        self.total_steps = trainer.cfg.schedule.steps
        self.batches: queue.Queue[ProducedBatch | BaseException] = queue.Queue()
        self._queued: list[ProducedBatch] = []  # mirror of the queue's batches (for checkpoints)
        for b in restored or []:
            self._put(b)
        self.next_step = first_step  # the step whose batch is generated now / next
        self.version = version
        self.counters = {"aborted_requests": 0, "resubmitted_groups": 0, "continued_samples": 0,
                         "dropped_stale_groups": 0, "regenerated_groups": 0, "weight_updates": 0,
                         "kept_requests": 0}
        self.counters.update(counters or {})
        self._sampler_at_batch_start: dict | None = None
        self._spanning: set[str] = set()  # request ids in flight across a kept (vLLM) weight update
        self._request_ids = 0
        self._open: asyncio.Event | None = None
        self._version_cond: asyncio.Condition | None = None
        self._task: asyncio.Task | None = None

    def _put(self, b: ProducedBatch) -> None:
        self._queued.append(b)
        self.batches.put(b)

    def take(self, step: int, timeout_s: float = 5.0) -> ProducedBatch:
        """Block (main thread) until the batch of ``step`` is ready; a producer failure is re-raised."""
        while True:
            try:
                item = self.batches.get(timeout=timeout_s)
            except queue.Empty:
                if self._task is not None and self._task.done() and self.batches.empty():
                    raise RuntimeError("the rollout producer stopped without producing step "
                                       f"{step}'s batch")
                continue
            if isinstance(item, BaseException):
                raise RuntimeError(f"the rollout producer failed: {item!r}") from item  # noqa: TRY004
            self._queued.remove(item)
            if item.step != step:
                raise RuntimeError(f"rollout producer handed over step {item.step}'s batch at step {step}")
            return item

    # ------------------------------------------------------------------- control (producer loop)
    async def start(self) -> None:
        """Start producing (on the producer loop)."""
        self._open = asyncio.Event()
        self._open.set()
        self._version_cond = asyncio.Condition()
        self._task = asyncio.get_running_loop().create_task(self._main())

    async def before_update(self) -> None:
        """Close the gate, hold new requests in the engine client and abort the ones in flight."""
        self._open.clear()
        engine = self.t.engine
        # the base class's client-side pause only (a server-side pause is the weight update's business)
        await RolloutEngine.pause(engine)
        self.counters["aborted_requests"] += await engine.abort()

    async def after_update(self, version: int) -> None:
        """The engine serves ``version`` now: release held requests and the gate."""
        await RolloutEngine.resume(self.t.engine)
        self.counters["weight_updates"] += 1
        async with self._version_cond:
            self.version = version
            self._version_cond.notify_all()
        self._open.set()

    async def update_keeping(self, weights_dir: str, version: int) -> None:
        """vLLM, ``partial_rollout: continue``: the server keeps its requests frozen across the reload
        of ``weights_dir`` (they finish with the new weights); then ``version`` is served."""
        self._open.clear()

        def frozen(request_ids: list[str]) -> None:  # generated across the update: old and new weights
            self._spanning.update(request_ids)
            self.counters["kept_requests"] += len(request_ids)

        await self.t.engine.update_weights_keeping_requests(weights_dir, str(version), frozen)
        await self.after_update(version)

    async def stop(self) -> None:
        """Stop producing and abort what is in flight."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await self.t.engine.abort()
            await asyncio.gather(self._task, return_exceptions=True)

    async def snapshot(self) -> dict:
        """The producer's state for a checkpoint (on the loop, so the sampler is not moving)."""
        sampler = self._sampler_at_batch_start or self.t.sampler.state_dict()
        return {"queued": [batch_to_json(b) for b in self._queued], "next_step": self.next_step,
                "sampler": sampler, "counters": dict(self.counters), "version": self.version,
                "max_staleness": self.max_staleness}

    async def regenerate(self, group: GroupRecord, step: int) -> GroupRecord:
        """Generate ``group``'s prompt again with the current weights (a group found too stale)."""
        new = await self._group(group.row, group.prompt_ids, step, rnd=100 + group.rnd, index=group.index)
        await self._score([new])
        return new

    # ------------------------------------------------------------------- production
    async def _main(self) -> None:
        try:
            while self.next_step <= self.total_steps:
                s = self.next_step
                async with self._version_cond:
                    await self._version_cond.wait_for(lambda s=s: self.version >= s - 1 - self.max_staleness)
                self._sampler_at_batch_start = self.t.sampler.state_dict()
                b = await self._make_batch(s)
                self.next_step = s + 1
                self._sampler_at_batch_start = None
                self._put(b)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the trainer thread, which re-raises
            self.batches.put(e)

    async def _make_batch(self, step: int) -> ProducedBatch:
        t, cfg = self.t, self.t.cfg
        want = cfg.schedule.prompts_per_step
        stats = {"gen_tokens": 0, "gen_time": 0.0, "reward_time": 0.0, "groups_seen": 0, "groups_zero_var": 0,
                 "rounds": 0, "errors": 0, "timeouts": 0}
        kept: list[GroupRecord] = []
        rnd = 0
        t_start = time.time()
        while True:
            rows = [t.train_ds.rows[i] for i in t.sampler.next_indices(want - len(kept))]
            groups = await asyncio.gather(*[self._group(row, t.tok.encode(row.prompt), step, rnd, i)
                                            for i, row in enumerate(rows)])
            t0 = time.time()
            rr = await self._score(groups)
            stats["reward_time"] += time.time() - t0
            stats["errors"] += rr.errors
            stats["timeouts"] += rr.timeouts
            for f in rr.failures[:2]:
                _log(f"megarl train: reward failure contained ({f}); fallback {cfg.reward.fallback}")
            for g in groups:
                stats["gen_tokens"] += sum(len(s.token_ids) for s in g.samples)
                stats["groups_seen"] += 1
                zero_var = len(set(g.rewards)) == 1
                stats["groups_zero_var"] += int(zero_var)
                if not (cfg.sampling.dynamic and zero_var):
                    kept.append(g)
            rnd += 1
            stats["rounds"] = rnd
            if not cfg.sampling.dynamic or len(kept) >= want or rnd >= cfg.sampling.max_rounds:
                break
        stats["gen_time"] = time.time() - t_start - stats["reward_time"]
        return ProducedBatch(step=step, groups=kept, stats=stats)

    async def _score(self, groups: list[GroupRecord]):
        t = self.t
        texts = [t.tok.decode(s.token_ids) for g in groups for s in g.samples]
        answers = [g.row.answer for g in groups for _ in g.samples]
        rr = await asyncio.to_thread(t.rewards, texts, answers)
        i = 0
        for g in groups:
            k = len(g.samples)
            g.texts = texts[i:i + k]
            g.rewards = rr.scalar[i:i + k].tolist()
            g.reward_dims = {name: v[i:i + k].tolist() for name, v in rr.dims.items()}
            i += k
        return rr

    async def _request(self, prompt_ids: list[int], n: int, sampling):
        """One engine request, started only while the gate is open; a request aborted before it
        produced any token is simply asked again (after the update)."""
        while True:
            await self._open.wait()
            self._request_ids += 1
            rid = f"megarl-async-{id(self):x}-{self._request_ids}"
            res = await self.t.engine.generate(prompt_ids, n=n, sampling=sampling, request_id=rid)
            res.request_id = rid
            if any(s.finish_reason != "abort" or s.token_ids for s in res.samples):
                return res
            self.counters["resubmitted_groups"] += 1

    async def _group(self, row: PromptRow, prompt_ids: list[int], step: int, rnd: int, index: int) -> GroupRecord:
        """The ``n`` samples of one prompt, with the partial-rollout policy at weight updates."""
        t = self.t
        n = t.cfg.rollout.n
        sp = t._sampling_params(step, rnd, index)
        while True:
            res = await self._request(prompt_ids, n, sp)
            kept = res.request_id in self._spanning  # generated across a kept update: old and new weights
            self._spanning.discard(res.request_id)
            samples = [SampleRecord(list(s.token_ids), [float(x) for x in s.logprobs], s.finish_reason,
                                    _version_of(s.weight_version, self.version), mixed=kept)
                       for s in res.samples]
            if all(s.finish_reason != "abort" for s in samples):
                return GroupRecord(row, prompt_ids, samples, rnd=rnd, index=index)
            if self.partial == "abort":
                self.counters["resubmitted_groups"] += 1
                continue
            done = await asyncio.gather(*[self._continue(prompt_ids, s, sp, j) for j, s in enumerate(samples)])
            return GroupRecord(row, prompt_ids, list(done), rnd=rnd, index=index)

    async def _continue(self, prompt_ids: list[int], s: SampleRecord, sp, j: int) -> SampleRecord:
        """Continue an aborted sample from its prefix (new weights) until it finishes."""
        import dataclasses

        while s.finish_reason == "abort":
            left = sp.max_new_tokens - len(s.token_ids)
            if left <= 0:
                s.finish_reason = "length"
                break
            self.counters["continued_samples"] += 1
            seed = None if sp.seed is None else (sp.seed * 31 + 7 * j + len(s.token_ids)) % (2 ** 31)
            res = await self._request(prompt_ids + s.token_ids, 1,
                                      dataclasses.replace(sp, max_new_tokens=left, seed=seed))
            part = res.samples[0]
            v = _version_of(part.weight_version, self.version)
            s = SampleRecord(s.token_ids + list(part.token_ids), s.logprobs + [float(x) for x in part.logprobs],
                             part.finish_reason, min(s.version, v), mixed=s.mixed or (bool(s.token_ids)
                                                                                       and v != s.version))
        return s


def batch_to_json(b: ProducedBatch) -> dict:
    """A produced batch as plain JSON data (checkpoints)."""
    return {"step": b.step, "stats": b.stats, "groups": [{
        "row": [g.row.prompt, g.row.answer, g.row.task, g.row.source], "prompt_ids": g.prompt_ids,
        "rewards": g.rewards, "reward_dims": g.reward_dims, "texts": g.texts, "rnd": g.rnd, "index": g.index,
        "samples": [[s.token_ids, s.logprobs, s.finish_reason, s.version, s.mixed] for s in g.samples]}
        for g in b.groups]}


def batch_from_json(d: dict) -> ProducedBatch:
    """The inverse of ``batch_to_json``."""
    groups = [GroupRecord(PromptRow(*g["row"]), g["prompt_ids"], [SampleRecord(*s) for s in g["samples"]],
                          g["rewards"], g["reward_dims"], g["texts"], g["rnd"], g["index"]) for g in d["groups"]]
    return ProducedBatch(step=d["step"], groups=groups, stats=d["stats"])
