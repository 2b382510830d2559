"""The streaming scheduler: per-prompt allocation within a step budget, as samples land.

The rollout collector hands a step to ``StreamingScheduler`` when the run's allocator is a
``StreamingAllocator`` (megarl/trainer/allocation.py). Per step:

- prompts ("slots") are opened from the sampler, in order, while fewer than ``want`` are committed
  or open and the budget can still hold a whole group for one more: each open slot *reserves* ``n``
  samples (and ``n * max_new_tokens`` tokens), so decisions never run out of budget;
- each slot's samples are requested in chunks (engine requests of the allocator's ``request_size``
  samples, or one request per decision; seeded by (step, chunk, slot)); a chunk's samples are
  scored as soon as it lands;
- the allocator's ``decide`` sees the slot's outcomes over the chunks landed *in issue order* (a
  chunk that lands early waits for the ones issued before it), so its decisions, and therefore what
  the step samples, do not depend on timing: a resumed run repeats them;
- a decision is a target sample count (more samples are requested up to it; ``n`` commits the
  group) or ``ABANDON``: the slot's requests in flight are aborted on the engine, its unspent
  reservation goes back to the budget and fresh prompts may open.

An abandoned slot is charged the samples it issued (its in-flight ones included, whether or not they
landed before the abort) and, against a token budget, the tokens of its landed prefix plus
``max_new_tokens`` per other issued sample: charges are a function of the decisions alone. The
committed groups go through the round processors as one round and into the batch in slot order; the
allocator's ``end_step`` then updates its history with every slot of the step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.plugin.allocation import ABANDON, PromptView, StreamingAllocator
from megarl.trainer.collector import count_samples, empty_stats
from megarl.trainer.rollouts import CollectedBatch, GroupRecord, SampleRecord

CHUNK_ROUND = 200  # sampling seeds of streamed chunks: round CHUNK_ROUND + chunk number


def concat_results(parts: list[Any]) -> Any:
    """Reward results of consecutive sample ranges as one (same fields as each part)."""
    out = dataclasses.replace(
        parts[0],
        scalar=torch.cat([p.scalar for p in parts]),
        dims={k: torch.cat([p.dims[k] for p in parts]) for k in parts[0].dims},
        errors=sum(p.errors for p in parts),
        timeouts=sum(p.timeouts for p in parts),
        worker_deaths=sum(p.worker_deaths for p in parts),
        failures=[f for p in parts for f in p.failures],
    )
    if parts[0].correct is not None:
        out.correct = torch.cat([p.correct for p in parts])
    return out


class TaggedEngine:
    """The engine as one chunk's workflow sees it: every request gets an id of this chunk, so the
    chunk's requests in flight can be aborted on the engine; other attributes are the engine's."""

    def __init__(self, inner: Any, prefix: str):
        self.inner, self.prefix, self.live, self._k = inner, prefix, set(), 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, prompt_ids: Any, n: int = 1, sampling: Any = None, **kw: Any) -> Any:
        """The engine's ``generate`` under a request id of this chunk."""
        self._k += 1
        rid = f"{self.prefix}-{self._k}"
        kw["request_id"] = rid
        self.live.add(rid)
        try:
            return await self.inner.generate(prompt_ids, n=n, sampling=sampling, **kw)
        finally:
            self.live.discard(rid)

    async def abort_live(self) -> int:
        """Abort this chunk's requests in flight on the engine; how many the engine aborted."""
        return sum([await self.inner.abort(rid) for rid in list(self.live)])


@dataclass
class Slot:
    """One prompt of the step: its chunks, the samples landed in issue order, its state."""

    uid: int
    index: int
    row: Any
    prompt_ids: list[int]
    issued: int = 0
    state: str = "open"  # open | committed | abandoned
    chunks: dict[int, tuple[int, Any]] = field(default_factory=dict)  # chunk -> (size, result)
    next_chunk: int = 0  # the first chunk not yet in the prefix
    samples: list[SampleRecord] = field(default_factory=list)
    outcomes: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    scores: list[Any] = field(default_factory=list)  # the landed chunks' RewardResults, in order
    engines: dict[int, TaggedEngine] = field(default_factory=dict)

    def view(self, n: int) -> PromptView:
        """What the allocator sees of this slot."""
        return PromptView(self.uid, self.index, tuple(self.outcomes), tuple(self.rewards), n)

    def tokens(self) -> int:
        """Tokens of the landed prefix."""
        return sum(len(s.token_ids) for s in self.samples)


class StreamingScheduler:
    """One step of streaming allocation with ``collector``'s engine, workflow, rewards and
    processors (see the module docstring)."""

    def __init__(self, collector: Any, allocator: StreamingAllocator):
        self.c, self.alloc = collector, allocator
        self.n = collector.n
        self.max_new = collector.sampling(0, 0, 0).max_new_tokens

    async def collect(self, step: int) -> CollectedBatch:
        """The committed groups of ``step`` and its statistics (budget counters included)."""
        n = self.n
        self.step, self.stats = step, empty_stats()
        self.budget = self.alloc.budget(n, self.max_new)
        self.slots: list[Slot] = []
        self.pending: dict[asyncio.Task, tuple[Slot, int]] = {}
        self.stopped: list[asyncio.Task] = []
        self.res_samples = self.res_tokens = 0  # reserved: open slots' n, charged: the rest
        self.counts = {"opened": 0, "committed": 0, "abandoned": 0, "aborted": 0, "abandoned_samples": 0}
        t0 = time.time()
        try:
            while True:
                while self._can_open():
                    await self._open()
                if not self.pending:
                    break
                done, _ = await asyncio.wait(self.pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=lambda t: (self.pending[t][0].index, self.pending[t][1])):
                    if task not in self.pending:  # its prompt was abandoned by an earlier one of these
                        continue
                    slot, chunk = self.pending.pop(task)
                    if slot.state == "open":
                        slot.chunks[chunk] = (slot.chunks[chunk][0], task.result())
                        await self._advance(slot)
        finally:
            for task in list(self.pending):
                task.cancel()
            await asyncio.gather(*self.pending, *self.stopped, return_exceptions=True)
        self.stats["gen_time"] += time.time() - t0
        return await self._finish(step)

    # ------------------------------------------------------------------ budget and slots
    def _can_open(self) -> bool:
        live = self.counts["committed"] + sum(s.state == "open" for s in self.slots)
        if live >= self.alloc.want or self.res_samples + self.n > self.budget.samples:
            return False
        return self.budget.tokens is None or self.res_tokens + self.n * self.max_new <= self.budget.tokens

    async def _open(self) -> None:
        (uid,) = self.c.sampler.next_indices(1)
        row = self.c.dataset.rows[uid]
        slot = Slot(uid, len(self.slots), row, self.c.tok.encode(row.prompt))
        self.slots.append(slot)
        self.counts["opened"] += 1
        self.res_samples += self.n
        self.res_tokens += self.n * self.max_new
        await self._apply(slot, self.alloc.decide(slot.view(self.n)))

    async def _apply(self, slot: Slot, target: int) -> None:
        """Carry out a decision on ``slot``."""
        landed = len(slot.outcomes)
        if target == ABANDON:
            await self._abandon(slot)
            return
        if not (landed < target <= self.n):
            raise ValueError(
                f"allocator {type(self.alloc).__name__}: decide() returned {target} for a prompt with "
                f"{landed} of {self.n} samples; expected ABANDON or a target in ({landed}, {self.n}]"
            )
        if target > slot.issued:
            self._issue(slot, target - slot.issued)

    def _issue(self, slot: Slot, k: int) -> None:
        """``k`` more samples for ``slot``, as requests of the allocator's ``request_size``."""
        size = getattr(self.alloc, "request_size", 0) or k
        while k > 0:
            m, k = min(size, k), k - min(size, k)
            chunk = len(slot.chunks)
            eng = TaggedEngine(
                self.c.engine, f"megarl-stream-{id(self):x}-s{self.step}-p{slot.index}-c{chunk}"
            )
            slot.engines[chunk] = eng
            slot.chunks[chunk] = (m, None)
            slot.issued += m
            sp = self.c.sampling(self.step, CHUNK_ROUND + chunk, slot.index)
            task = asyncio.ensure_future(self._chunk(eng, slot, m, sp))
            self.pending[task] = (slot, chunk)

    async def _chunk(self, eng: TaggedEngine, slot: Slot, k: int, sp: Any) -> tuple[list, Any]:
        """``k`` samples of the slot's prompt, scored: (sample records, RewardResult)."""
        v0 = self.c.version()
        trajs = await self.c.workflow.run(eng, slot.row.prompt, slot.row.answer, slot.prompt_ids, k, sp)
        recs = self.c.records(trajs, v0, self.c.version())
        t0 = time.time()
        rr = await asyncio.to_thread(self.c.rewards, [r.text for r in recs], [slot.row.answer] * k)
        self.stats["reward_time"] += time.time() - t0
        return recs, rr

    async def _advance(self, slot: Slot) -> None:
        """Extend the slot's prefix by every landed chunk in issue order, deciding after each."""
        while slot.state == "open" and slot.chunks.get(slot.next_chunk, (0, None))[1] is not None:
            recs, rr = slot.chunks[slot.next_chunk][1]
            slot.chunks[slot.next_chunk] = (len(recs), None)  # the prefix holds it now
            slot.engines.pop(slot.next_chunk, None)
            slot.next_chunk += 1
            slot.samples += recs
            slot.scores.append(rr)
            slot.rewards += [float(x) for x in rr.scalar]
            verdicts = rr.correct if rr.correct is not None else rr.scalar > 0
            slot.outcomes += [float(bool(v)) for v in verdicts]
            if len(slot.outcomes) >= self.n:
                self._commit(slot)
            else:
                await self._apply(slot, self.alloc.decide(slot.view(self.n)))

    def _commit(self, slot: Slot) -> None:
        slot.state = "committed"
        self.counts["committed"] += 1
        self.res_tokens -= self.n * self.max_new - slot.tokens()

    async def _abandon(self, slot: Slot) -> None:
        slot.state = "abandoned"
        self.counts["abandoned"] += 1
        self.counts["abandoned_samples"] += slot.issued
        landed = len(slot.outcomes)
        self.res_samples -= self.n - slot.issued
        self.res_tokens -= self.n * self.max_new - slot.tokens() - (slot.issued - landed) * self.max_new
        for task, (s, _) in list(self.pending.items()):
            if s is slot:
                self.pending.pop(task)
                self.stopped.append(task)
        for eng in slot.engines.values():
            self.counts["aborted"] += await eng.abort_live()
        for task in self.stopped:
            task.cancel()  # an engine without an abort route: the cancelled call stops the request

    # ------------------------------------------------------------------ the step's result
    async def _finish(self, step: int) -> CollectedBatch:
        st, n = self.stats, self.n
        kept = [s for s in self.slots if s.state == "committed"]
        groups = [GroupRecord(s.row, s.uid, s.prompt_ids, s.samples[:n], rnd=0, index=s.index) for s in kept]
        t0 = time.time()
        if groups:
            rr = concat_results([r for s in kept for r in s.scores])
            await self.c.process(groups, rr, step, 0, st)
        st["reward_time"] += time.time() - t0
        st["gen_tokens"] = sum(s.tokens() for s in self.slots)
        st["rounds"] = 1
        for g in groups:
            vals = torch.tensor(g.rewards, dtype=torch.float64)
            zero_var = bool((vals == vals[0]).all())
            st["groups_seen"] += 1
            st["groups_zero_var"] += int(zero_var)
            count_samples(st, g, effective=not zero_var)
        st["budget_samples"] = sum(s.issued for s in self.slots)
        st["budget_tokens"] = st["gen_tokens"]
        st["budget_fixed"] = self.alloc.want * n
        st["method"].update(
            {
                "alloc/prompts_opened": self.counts["opened"],
                "alloc/prompts_committed": self.counts["committed"],
                "alloc/prompts_abandoned": self.counts["abandoned"],
                "alloc/samples_abandoned": self.counts["abandoned_samples"],
                "alloc/requests_aborted": self.counts["aborted"],
            }
        )
        st["method"].update(
            self.alloc.end_step(step, [(s.view(n), s.state == "committed") for s in self.slots])
        )
        return CollectedBatch(step=step, groups=groups, stats=st)
