"""The rollout collector: sample -> generate -> score -> shape -> filter, for both loops.

One ``RolloutCollector`` per run on rank 0. ``await collect(step)`` builds the groups of one step:
the allocator decides how many prompts each round samples and which groups stay (a streaming
allocator instead decides per prompt as samples land: megarl/trainer/streaming.py; a prefix
allocator continues only chosen short prefixes: megarl/trainer/prefix_rounds.py; a
``PromptChooser`` picks the prompts itself instead of the shuffled sampler); the workflow
makes ``n`` samples of each prompt through the engine; the run's reward functions score
them; the round processors (reward shaping, judges, method scores) run in order. The synchronous
loop runs it to completion per step; the asynchronous loop runs it ahead in its producer thread
with a gated engine (megarl/trainer/rollout_producer.py). Sampling seeds depend only on (seed,
step, round, prompt index), so a resumed run draws the same samples.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from megarl.plugin.allocation import GroupOutcome, PrefixAllocator, PromptChooser
from megarl.plugin.rounds import RolloutRound
from megarl.trainer.allocation import StreamingAllocator
from megarl.trainer.rollouts import CollectedBatch, GroupRecord, SampleRecord


class LockedRewards:
    """A ``RewardComputer`` shared by threads (the producer, evaluation, a workflow's score calls): one call
    at a time (contained reward functions talk to one worker process over a pipe)."""

    def __init__(self, inner):
        self.inner = inner
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        """The reward dimensions' names."""
        return self.inner.names

    @property
    def correct_name(self) -> str | None:
        """The correctness check's dimension (None when ambiguous)."""
        return self.inner.correct_name

    def __call__(self, responses: list[str], answers: list[str]):
        with self._lock:
            return self.inner(responses, answers)

    def close(self) -> None:
        """Stop the contained worker."""
        with self._lock:
            self.inner.close()


def empty_stats() -> dict:
    """The rollout statistics of a step before any round."""
    return {
        "gen_tokens": 0,
        "gen_time": 0.0,
        "reward_time": 0.0,
        "groups_seen": 0,
        "groups_zero_var": 0,
        "rounds": 0,
        "errors": 0,
        "timeouts": 0,
        "worker_deaths": 0,
        "budget_samples": 0,
        "budget_tokens": 0,
        "budget_samples_effective": 0,
        "budget_tokens_effective": 0,
        "budget_groups_effective": 0,
        "budget_fixed": 0,
        "method": {},
    }


class RolloutCollector:
    """Builds the groups of a step (see the module docstring).

    engine: the rollout engine (or the asynchronous loop's gated wrapper); rewards: ``(texts,
    answers) -> RewardResult``; workflow: a ``RolloutWorkflow``; processors: ``RoundProcessor``s in
    order; allocator: an ``Allocator``; sampling: ``sampling(step, round, index) -> SamplingParams``;
    version: the engine's current policy version (versions of samples that carry none).
    """

    def __init__(
        self,
        *,
        engine: Any,
        tokenizer: Any,
        dataset: Any,
        sampler: Any,
        rewards: Any,
        workflow: Any,
        processors: list,
        allocator: Any,
        sampling: Callable[..., Any],
        n: int,
        weights: dict[str, float],
        fallback: float,
        version: Callable[[], int],
        log: Callable[[str], None] = print,
    ):
        self.engine, self.tok, self.dataset, self.sampler = engine, tokenizer, dataset, sampler
        self.rewards, self.workflow, self.processors, self.allocator = (
            rewards,
            workflow,
            processors,
            allocator,
        )
        self.sampling, self.n, self.weights, self.fallback = sampling, n, weights, fallback
        self.version, self.log = version, log
        if isinstance(allocator, PromptChooser):
            allocator.bind([r.task for r in dataset.rows], sampler.seed)

    async def collect(self, step: int) -> CollectedBatch:
        """The kept groups of ``step`` and the step's rollout statistics."""
        if isinstance(self.allocator, PrefixAllocator):
            from megarl.trainer.prefix_rounds import PrefixScheduler

            return await PrefixScheduler(self, self.allocator).collect(step)
        if isinstance(self.allocator, StreamingAllocator):
            from megarl.trainer.streaming import StreamingScheduler

            return await StreamingScheduler(self, self.allocator).collect(step)
        stats = empty_stats()
        kept: list[GroupRecord] = []
        rnd = 0
        chooser = self.allocator if isinstance(self.allocator, PromptChooser) else None
        while True:
            k = self.allocator.want - len(kept)
            uids = chooser.next_prompts(step, k) if chooser else list(self.sampler.next_indices(k))
            groups = await self._round(uids, step, rnd, stats)
            if chooser is not None:
                outcomes = [GroupOutcome(g.uid, g.row.task, tuple(g.rewards)) for g in groups]
                stats["method"].update(chooser.observe(step, outcomes))
            for g in groups:
                stats["groups_seen"] += 1
                vals = torch.tensor(g.rewards, dtype=torch.float64)
                zero_var = bool((vals == vals[0]).all())
                stats["groups_zero_var"] += int(zero_var)
                count_samples(stats, g, issued=True)
                if self.allocator.keep(vals):
                    kept.append(g)
                    count_samples(stats, g, effective=not zero_var)
            rnd += 1
            stats["rounds"] = rnd
            if not self.allocator.more(len(kept), rnd):
                break
        stats["budget_fixed"] = self.allocator.want * self.n
        return CollectedBatch(step=step, groups=kept, stats=stats)

    async def regenerate(self, group: GroupRecord, step: int) -> GroupRecord:
        """``group``'s prompt sampled again with the current weights (a group found too stale)."""
        stats = empty_stats()
        (new,) = await self._round([group.uid], step, 100 + group.rnd, stats, first_index=group.index)
        return new

    def records(self, trajs: list, v0: int, v1: int) -> list[SampleRecord]:
        """A prompt's samples as sample records (``v0``/``v1``: the policy version before and
        after they were generated, for samples that carry none)."""
        return [
            SampleRecord(
                t.token_ids,
                t.logprobs,
                t.finish_reason,
                v0 if t.version is None else t.version,
                mixed=t.mixed or (t.version is None and v1 != v0),
                truncated=t.truncated,
                text=self.tok.decode(t.token_ids) if t.text is None else t.text,
                loss_mask=t.loss_mask,
                turn_spans=t.turn_spans,
                turn_rewards=t.turn_rewards,
                extras=t.extras,
            )
            for t in trajs
        ]

    async def _round(
        self, uids: list[int], step: int, rnd: int, stats: dict, first_index: int = 0
    ) -> list[GroupRecord]:
        rows = [self.dataset.rows[i] for i in uids]
        prompt_ids = [self.tok.encode(r.prompt) for r in rows]
        t0 = time.time()
        v0 = self.version()
        trajs = await asyncio.gather(
            *[
                self.workflow.run(
                    self.engine, row.prompt, row.answer, p, self.n, self.sampling(step, rnd, first_index + i)
                )
                for i, (row, p) in enumerate(zip(rows, prompt_ids))
            ]
        )
        v1 = self.version()
        stats["gen_time"] += time.time() - t0
        t0 = time.time()
        groups = []
        for i, (uid, row, p, ts) in enumerate(zip(uids, rows, prompt_ids, trajs)):
            samples = self.records(ts, v0, v1)
            stats["gen_tokens"] += sum(len(s.token_ids) for s in samples)
            groups.append(GroupRecord(row, uid, p, samples, rnd=rnd, index=first_index + i))
        texts = [s.text for g in groups for s in g.samples]
        answers = [g.row.answer for g in groups for _ in g.samples]
        rr = await asyncio.to_thread(self.rewards, texts, answers)
        await self.process(groups, rr, step, rnd, stats)
        stats["reward_time"] += time.time() - t0
        return groups

    async def process(self, groups: list[GroupRecord], rr: Any, step: int, rnd: int, stats: dict) -> None:
        """Fill ``groups``' rewards from their samples' ``RewardResult`` ``rr`` (in group order) after
        the round processors (shaping, judges, method scores) ran over them as one round."""
        stats["errors"] += rr.errors
        stats["timeouts"] += rr.timeouts
        stats["worker_deaths"] += rr.worker_deaths
        for f in rr.failures[:2]:
            self.log(f"megarl train: reward failure contained ({f}); fallback {self.fallback}")
        texts = [s.text for g in groups for s in g.samples]
        r = RolloutRound(
            [g.row.prompt for g in groups],
            [g.row.answer for g in groups],
            [g.uid for g in groups],
            [g.prompt_ids for g in groups],
            [s.token_ids for g in groups for s in g.samples],
            texts,
            dict(rr.dims),
            rr.scalar,
            self.n,
            step,
            rnd,
            dict(self.weights),
            correct=rr.correct,
            extras=sample_extras(groups),
        )
        extras: dict[str, list] = dict(r.extras)
        for proc in self.processors:
            out = await proc.process(r)
            if out.scalar is not None:
                r.scalar = out.scalar.to(torch.float32)
            extras.update(out.extras)
            stats["method"].update(out.metrics)
        k = 0
        for g in groups:
            sl = slice(k, k + len(g.samples))
            g.rewards = r.scalar[sl].tolist()
            g.reward_dims = {name: v[sl].tolist() for name, v in rr.dims.items()}
            g.extras = {name: list(v[sl]) for name, v in extras.items()}
            k += len(g.samples)


def sample_extras(groups: list[GroupRecord]) -> dict[str, list]:
    """The workflow's per-sample extras of a round, name -> [G * n] in sample order; every sample
    must carry the same names (the error names the first sample that differs)."""
    samples = [s for g in groups for s in g.samples]
    names = set(samples[0].extras or {}) if samples else set()
    for i, s in enumerate(samples):
        if set(s.extras or {}) != names:
            raise ValueError(
                f"rollout workflow extras: sample {i} carries {sorted(s.extras or {})}, "
                f"sample 0 carries {sorted(names)}; every sample of a round must carry the same names"
            )
    return {k: [s.extras[k] for s in samples] for k in sorted(names)}  # type: ignore[index]


def count_samples(stats: dict, g: GroupRecord, issued: bool = False, effective: bool = False) -> None:
    """Add group ``g``'s samples and tokens to the step's budget counters: ``issued`` (generated)
    or ``effective`` (in the batch, in a group whose rewards differ: a non-zero gradient)."""
    tokens = sum(len(s.token_ids) for s in g.samples)
    if issued:
        stats["budget_samples"] += len(g.samples)
        stats["budget_tokens"] += tokens
    if effective:
        stats["budget_samples_effective"] += len(g.samples)
        stats["budget_tokens_effective"] += tokens
        stats["budget_groups_effective"] += 1
