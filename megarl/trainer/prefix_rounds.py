"""Prefix-then-continue rounds: short prefixes first, then only the chosen samples run to the end.

The rollout collector hands a step to ``PrefixScheduler`` when the run's allocator is a
``PrefixAllocator`` (megarl/plugin/allocation.py). Per step:

- the sampler gives ``want`` prompts; each gets ``n`` prefixes in one engine request of at most
  ``prefix_tokens`` new tokens (seeded by (step, prompt));
- the allocator's ``choose(step, view)`` sees each prompt's prefixes (tokens, logprobs, which ones
  already ended) and returns which samples the batch keeps, with per-sample extras;
- a prompt with fewer than two kept samples is dropped before anything else is generated; the
  other kept prefixes that did not end are continued from their prefix on the engine
  (``megarl.rollout.engine.continue_from_prefix``: the prefix's tokens and logprobs are kept as
  they are, never re-sampled), one request per sample seeded by (step, sample, prompt);
- the kept samples are scored; each prompt's group holds its kept samples only, in prefix order,
  with the allocator's extras of those samples (``batch.extras``); then ``end_step`` gets every
  prompt's view, decision and the kept samples' rewards and lengths (empty for a dropped prompt).

Groups vary in size, so round processors (which see ``n`` samples per prompt) are refused. Budget
counters: ``budget/samples`` counts the prefixes started, ``budget/tokens`` every generated token
(prefixes, dropped ones included, and continuations).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import torch

from megarl.plugin.allocation import Continuation, PrefixAllocator, PrefixView
from megarl.rollout.engine import continue_from_prefix
from megarl.rollout.workflow import version_of
from megarl.trainer.collector import count_samples, empty_stats
from megarl.trainer.rollouts import CollectedBatch, GroupRecord, SampleRecord

PREFIX_ROUND = 300  # sampling seeds of the prefixes: round PREFIX_ROUND
CONTINUE_ROUND = 400  # of sample j's continuation: round CONTINUE_ROUND + j


@dataclasses.dataclass
class PrefixPrompt:
    """One prompt of the step: its prefixes, the decision and the finished kept samples."""

    uid: int
    index: int
    row: Any
    prompt_ids: list[int]
    prefixes: list[Any] = dataclasses.field(default_factory=list)  # engine Samples
    view: PrefixView | None = None
    decision: Continuation | None = None
    samples: list[SampleRecord] = dataclasses.field(default_factory=list)
    kept: list[int] = dataclasses.field(default_factory=list)
    continued_tokens: int = 0


class PrefixScheduler:
    """One step of prefix-then-continue allocation with ``collector``'s engine, sampler, rewards
    (see the module docstring)."""

    def __init__(self, collector: Any, allocator: PrefixAllocator):
        self.c, self.alloc = collector, allocator
        self.n = collector.n
        self.max_new = collector.sampling(0, 0, 0).max_new_tokens
        if allocator.prefix_tokens < 1:
            raise ValueError(
                f"{type(allocator).__name__}.prefix_tokens={allocator.prefix_tokens} must be >= 1"
            )
        if collector.processors:
            raise ValueError(
                f"allocator {type(allocator).__name__} keeps a variable number of samples per prompt; "
                "round processors (reward.shaping, round inputs, a method's processors) need groups of "
                "rollout.n samples and cannot run with it"
            )

    async def collect(self, step: int) -> CollectedBatch:
        """The kept groups of ``step`` and its statistics (budget counters included)."""
        st = empty_stats()
        uids = list(self.c.sampler.next_indices(self.alloc.want))
        prompts = [
            PrefixPrompt(u, i, self.c.dataset.rows[u], self.c.tok.encode(self.c.dataset.rows[u].prompt))
            for i, u in enumerate(uids)
        ]
        t0 = time.time()
        await asyncio.gather(*[self._prompt(step, p) for p in prompts])
        st["gen_time"] += time.time() - t0
        kept = [p for p in prompts if len(p.kept) >= 2]
        groups = [GroupRecord(p.row, p.uid, p.prompt_ids, p.samples, rnd=0, index=p.index) for p in kept]
        t0 = time.time()
        if groups:
            texts = [s.text for g in groups for s in g.samples]
            answers = [g.row.answer for g in groups for _ in g.samples]
            rr = await asyncio.to_thread(self.c.rewards, texts, answers)
            await self.c.process(groups, rr, step, 0, st)
        st["reward_time"] += time.time() - t0
        for p, g in zip(kept, groups):
            assert p.decision is not None
            g.extras = {
                **g.extras,
                **{k: [float(v[j]) for j in p.kept] for k, v in p.decision.extras.items()},
            }
            vals = torch.tensor(g.rewards, dtype=torch.float64)
            zero_var = bool((vals == vals[0]).all())
            st["groups_seen"] += 1
            st["groups_zero_var"] += int(zero_var)
            count_samples(st, g, effective=not zero_var)
        prefix_tokens = sum(len(s.token_ids) for p in prompts for s in p.prefixes)
        cont_tokens = sum(p.continued_tokens for p in prompts)
        st["gen_tokens"] = st["budget_tokens"] = prefix_tokens + cont_tokens
        st["budget_samples"] = self.n * len(prompts)
        st["budget_fixed"] = self.alloc.want * self.n
        st["rounds"] = 1
        st["method"].update(
            {
                "alloc/prefixes": float(self.n * len(prompts)),
                "alloc/samples_kept": float(sum(len(p.kept) for p in kept)),
                "alloc/samples_continued": float(
                    sum(1 for p in kept for j in p.kept if not self._ended(p.prefixes[j]))
                ),
                "alloc/prefix_tokens": float(prefix_tokens),
                "alloc/continuation_tokens": float(cont_tokens),
                "alloc/prompts_dropped": float(len(prompts) - len(kept)),
            }
        )
        done = {
            p.index: (tuple(g.rewards), tuple(len(s.token_ids) for s in g.samples))
            for p, g in zip(kept, groups)
        }
        views = [(p.view, p.decision, *done.get(p.index, ((), ()))) for p in prompts if p.view is not None]
        st["method"].update(self.alloc.end_step(step, views))  # type: ignore[arg-type]
        return CollectedBatch(step=step, groups=groups, stats=st)

    def _ended(self, s: Any) -> bool:
        return s.finish_reason != "length" or len(s.token_ids) >= self.max_new

    async def _prompt(self, step: int, p: PrefixPrompt) -> None:
        """Prefixes, decision and continuations of one prompt."""
        sp = self.c.sampling(step, PREFIX_ROUND, p.index)
        sp0 = dataclasses.replace(sp, max_new_tokens=min(self.alloc.prefix_tokens, self.max_new))
        res = await self.c.engine.generate(p.prompt_ids, n=self.n, sampling=sp0)
        p.prefixes = list(res.samples)
        p.view = PrefixView(
            p.uid,
            p.index,
            tuple(tuple(s.token_ids) for s in p.prefixes),
            tuple(tuple(float(x) for x in s.logprobs) for s in p.prefixes),
            tuple(self._ended(s) for s in p.prefixes),
            self.n,
            self.max_new,
        )
        dec = self.alloc.choose(step, p.view)
        self._check(dec)
        p.decision = dec
        p.kept = [j for j, k in enumerate(dec.keep) if k]
        if len(p.kept) < 2:
            return
        done = await asyncio.gather(*[self._finish_sample(step, p, j) for j in p.kept])
        v = self.c.version()
        p.samples = [self._record(s, v) for s in done]

    async def _finish_sample(self, step: int, p: PrefixPrompt, j: int) -> Any:
        s = p.prefixes[j]
        if self._ended(s):
            return s
        sp = self.c.sampling(step, CONTINUE_ROUND + j, p.index)
        sp = dataclasses.replace(sp, max_new_tokens=self.max_new - len(s.token_ids))
        out = await continue_from_prefix(self.c.engine, p.prompt_ids, s, sp)
        p.continued_tokens += len(out.token_ids) - len(s.token_ids)
        return out

    def _record(self, s: Any, v: int) -> SampleRecord:
        version = version_of(s.weight_version)
        return SampleRecord(
            list(s.token_ids),
            list(s.logprobs),
            s.finish_reason,
            v if version is None else version,
            mixed=bool(s.meta.get("mixed", False)),
            truncated=s.finish_reason == "length",
            text=self.c.tok.decode(s.token_ids),
        )

    def _check(self, dec: Continuation) -> None:
        name = type(self.alloc).__name__
        if len(dec.keep) != self.n:
            raise ValueError(f"allocator {name}: choose() kept {len(dec.keep)} flags for {self.n} prefixes")
        for k, v in dec.extras.items():
            if len(v) != self.n:
                raise ValueError(
                    f"allocator {name}: choose() extra {k!r} has {len(v)} values for {self.n} prefixes"
                )
