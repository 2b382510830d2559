"""Continuous batching for the embedded engine: every in-flight request decodes in one batch.

A worker thread owns the model while requests are in flight. Each step it (1) admits waiting
requests: they are prefilled together, one forward per prompt length with one row per request
(the prompt's keys, values and last logits are then repeated for the request's ``n`` rows), and
join the padded KV batch (``megarl.rollout.kv_batch``); (2) samples the next token of every row in
one call (``megarl.rollout.sampling.sample_rows``), each request drawing from its own seeded
generator; (3) lets requests that are done leave (all samples stopped, the token budget reached, or
aborted); (4) decodes one token for all remaining rows in one forward. A model whose cache cannot
be repeated (not the dynamic concatenating cache) prefills its ``n`` rows instead.

Requests submitted from an event loop (``submit(job, loop)``, what the engine does) reach the
worker at the end of the loop's turn, all at once: the prompts of a step that a caller gathers
(``asyncio.gather`` of one ``generate`` per prompt) start their tasks in the same turn, so they are
admitted at one step and prefilled in one forward per prompt length, rather than in as many groups
as the worker thread happens to find queued while the loop is still submitting.

The engine's condition lock is held for one step at a time, so weight loads, scoring and decoder
swaps slip in between steps (the worker lets go of the lock between steps while one of them waits);
a weight load first stops admissions and waits for the batch to drain, so every sample is generated
by one weight version.

A request's samples depend on its seed and its prompt only: its random draws come from its own
generator and cover its ``n`` rows at every step whatever else decodes. What the batch changes is
the floating-point rounding of the forward (padding masks and the row count of the matrix products
differ from a request decoded alone), a last-bit effect measured in docs/rollout.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.rollout.kv_batch import KVBatch, cache_layers, output_cache
from megarl.rollout.sampling import sample_rows
from megarl.rollout.types import EngineDeadError, GenerateRequest, Sample


@dataclass
class Job:
    """One request in the batch: its sampling state and the future its caller waits on."""

    req: GenerateRequest
    abort: threading.Event
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    gen: torch.Generator | None = None
    stop_ids: set[int] = field(default_factory=set)
    version: str = ""
    logits: torch.Tensor | None = None  # [n, V] fp32: the next-token logits of its rows
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    stop_reason: list[Any] = field(default_factory=list)
    steps: int = 0
    next: torch.Tensor | None = None  # [n]: the tokens sampled at the last step

    def result(self) -> list[Sample]:
        """The samples so far (unfinished ones end with "abort" when aborted, else "length")."""
        end = "abort" if self.abort.is_set() or self.future.cancelled() else "length"
        return [
            Sample(
                token_ids=self.tokens[i],
                logprobs=self.logprobs[i],
                finish_reason=self.finish[i] or end,
                weight_version=self.version,
                stop_reason=self.stop_reason[i],
            )
            for i in range(self.req.n)
        ]


def _seeded(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,))))
    return gen


class BatchScheduler:
    """The continuous-batching loop of one ``EmbeddedEngine``.

    Args:
      engine: the engine (its model, condition lock ``_lock``, ``dead_reason``, ``stop_hit``...).
      max_batch_rows: rows (samples) decoding at once; a request that does not fit waits, one
        larger than the cap decodes alone.
    """

    def __init__(self, engine: Any, max_batch_rows: int):
        if max_batch_rows < 1:
            raise ValueError(f"{engine.name}: max_batch_rows must be >= 1, got {max_batch_rows}")
        self.engine = engine
        self.max_batch_rows = max_batch_rows
        self.pending: list[Job] = []
        self.active: list[Job] = []
        self.batch: KVBatch | None = None
        self.mergeable: bool | None = None  # the model's cache pads and merges (learnt at the first prefill)
        self._worker: threading.Thread | None = None
        self._queue = threading.Lock()  # guards ``pending``, ``_staged``, ``_waiters`` and ``_worker``
        self._staged: dict[asyncio.AbstractEventLoop, list[Job]] = {}  # submitted this turn of a loop
        self._waiters = 0  # threads other than the worker waiting for the engine lock
        self._last_only: dict | None = None  # the forward's keyword for last-position logits only
        self.prefills = 0  # prefill forwards run (one per prompt length admitted at a step)

    # ----------------------------------------------------------------------------- threads
    def submit(self, job: Job, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Queue ``job``; it joins the batch at the next step (never waits for the model). With
        ``loop`` (the caller's running event loop) it is queued at the end of the loop's current
        turn, together with every job submitted during that turn (see the module docstring)."""
        with self._queue:
            if loop is None:
                self.pending.append(job)
                self._start()
                return
            staged = self._staged.get(loop)
            if staged is None:
                staged = self._staged[loop] = []
                loop.call_soon(self._flush, loop)
            staged.append(job)

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._queue:
            self.pending.extend(self._staged.pop(loop, ()))
            self._start()

    def kick(self) -> None:
        """Start the worker when there is work and none runs."""
        with self._queue:
            self._start()

    def _start(self) -> None:
        if self._worker is None and (self.pending or self.active):
            self._worker = threading.Thread(target=self._run, name=f"{self.engine.name}-batch", daemon=True)
            self._worker.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for the worker thread to stop (it stops when no request
        is left, or at once after the engine shut down)."""
        with self._queue:
            worker = self._worker
        if worker is not None:
            worker.join(timeout)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """The engine lock, for a thread other than the worker (a scorer, a weight load): while one
        waits, the worker lets go of the lock between steps."""
        with self._queue:
            self._waiters += 1
        try:
            self.engine._lock.acquire()
        finally:
            with self._queue:
                self._waiters -= 1
        try:
            yield
        finally:
            self.engine._lock.release()

    @property
    def busy(self) -> bool:
        """Requests are decoding (a weight load waits until this is False)."""
        return bool(self.active)

    def _run(self) -> None:
        lock = self.engine._lock
        while True:
            with lock:
                with self._queue:
                    idle = not self.active and (not self.pending or self._blocked())
                    if idle:
                        self._worker = None
                if idle:
                    lock.notify_all()
                    return
                try:
                    self.step()
                except Exception as e:  # the model failed: every caller of the batch gets the error
                    for job in self.active:
                        _fail(job, e)
                    self.active, self.batch = [], None
                if not self.active:
                    lock.notify_all()
            if self._waiters:
                time.sleep(0)  # let a waiting loader / scorer take the lock between steps

    def _blocked(self) -> bool:
        return self.engine._draining > 0

    # ----------------------------------------------------------------------------- one step
    @torch.no_grad()
    def step(self) -> None:
        """Admit, sample, retire, decode: one step of the batch (caller holds the engine lock)."""
        eng = self.engine
        if eng.dead_reason is not None:
            err = EngineDeadError(f"{eng.name}: engine shut down during generation ({eng.dead_reason})")
            with self._queue:
                waiting, self.pending = self.pending, []
            for job in self.active + waiting:
                _fail(job, err)
            self.active, self.batch = [], None
            return
        if not self._blocked():
            self._admit()
        self._sample([job for job in self.active if not (job.abort.is_set() or job.future.cancelled())])
        keep: list[int] = []
        still: list[Job] = []
        row = 0
        for job in self.active:
            n = job.req.n
            if job.abort.is_set() or job.future.cancelled() or self._done(job):
                _resolve(job)
            else:
                still.append(job)
                keep.extend(range(row, row + n))
            row += n
        self.active = still
        assert self.batch is not None or not still
        if self.batch is None:
            return
        self.batch.keep(keep)
        if not still:
            self.batch = None
            return
        logits = self.batch.step(torch.cat([job.next for job in still if job.next is not None]))
        row = 0
        for job in still:
            job.logits = logits[row : row + job.req.n]
            row += job.req.n

    def _admit(self) -> None:
        eng = self.engine
        rows = sum(job.req.n for job in self.active)
        joining: list[Job] = []
        with self._queue:
            waiting, self.pending = self.pending, []
        while waiting:
            job = waiting[0]
            if rows and (rows + job.req.n > self.max_batch_rows or self.mergeable is not True):
                break
            waiting.pop(0)
            job.version = eng.weight_version
            _init(job)
            if job.abort.is_set() or job.future.cancelled():
                _resolve(job)
                continue
            sp = job.req.sampling
            job.gen = _seeded(sp.seed)
            if eng.decoder is not None:  # an installed decode loop serves one request at a time
                if rows:
                    waiting.insert(0, job)
                    break
                try:
                    samples = eng.decode_alone(job.req, job.gen, job.abort)
                except Exception as e:
                    _fail(job, e)
                else:
                    if not job.future.done():
                        job.future.set_result(samples)
                continue
            job.stop_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eng.eos_token_ids))
            joining.append(job)
            rows += job.req.n
        with self._queue:
            self.pending = waiting + self.pending  # not admitted: first in line at the next step
        try:
            self._prefill(joining)
        except Exception as e:  # the requests that did not join fail with the model's error
            for job in joining:
                if job not in self.active:
                    _fail(job, e)
            raise

    def _prefill(self, joining: list[Job]) -> None:
        eng = self.engine
        by_len: dict[int, list[Job]] = {}  # one prefill per prompt length: equal lengths need no padding
        for job in joining:
            by_len.setdefault(len(job.req.prompt_ids), []).append(job)
        for length, group in by_len.items():
            ids = torch.tensor([list(j.req.prompt_ids) for j in group], dtype=torch.long)
            reps = torch.tensor([j.req.n for j in group], dtype=torch.long)
            rows = int(reps.sum())
            if self.mergeable is False and rows > len(group):  # a cache that cannot be repeated
                logits, cache = self._forward(ids.repeat_interleave(reps, 0))
            else:
                logits, cache = self._forward(ids)
                layers = cache_layers(cache)
                self.mergeable = layers is not None
                if rows > len(group):
                    if layers is None:
                        logits, cache = self._forward(ids.repeat_interleave(reps, 0))
                    else:  # the n rows of a request share its prompt's keys and values
                        for layer in layers:
                            layer.keys = layer.keys.repeat_interleave(reps, 0)
                            layer.values = layer.values.repeat_interleave(reps, 0)
                        logits = logits.repeat_interleave(reps, 0)
            if self.batch is None:
                self.batch = KVBatch(eng.model, eng._cache_arg_name())
            self.batch.join(cache, rows, length)
            row = 0
            for job in group:
                job.logits = logits[row : row + job.req.n]
                row += job.req.n
            self.active.extend(group)
        self.prefills += len(by_len)

    def _forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Prefill the prompts ``ids`` [R, L]: their next-token logits [R, V] in fp32 and the cache."""
        eng = self.engine
        if self._last_only is None:
            import inspect

            params = inspect.signature(eng.model.forward).parameters
            self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        out = eng.model(input_ids=ids, use_cache=True, **self._last_only)
        return out.logits[:, -1, :].float(), output_cache(out)

    def _sample(self, jobs: list[Job]) -> None:
        """The next token of every row of ``jobs`` (one ``sample_rows`` call), appended to the
        samples that go on."""
        if not jobs:
            return
        parts, rows = [], []
        for job in jobs:
            assert job.logits is not None and job.gen is not None
            parts.append((job.req.n, job.req.sampling, job.gen))
            rows.append(job.logits)
        logits = rows[0] if len(rows) == 1 else torch.cat(rows)
        nxt, lp = sample_rows(logits, parts)
        ids, lps = nxt.tolist(), lp.tolist()
        stop_hit = self.engine.stop_hit
        row = 0
        for job in jobs:
            sp, n = job.req.sampling, job.req.n
            job.steps += 1
            for i in range(n):
                if job.finish[i] is not None:
                    continue
                job.tokens[i].append(ids[row + i])
                job.logprobs[i].append(lps[row + i])
                hit = stop_hit(job.tokens[i], job.stop_ids, sp)
                if hit is not None:
                    job.finish[i], job.stop_reason[i] = "stop", hit[0]
            job.next = nxt[row : row + n]
            row += n

    @staticmethod
    def _done(job: Job) -> bool:
        return all(f is not None for f in job.finish) or job.steps >= job.req.sampling.max_new_tokens


def _init(job: Job) -> None:
    n = job.req.n
    job.tokens, job.logprobs = [[] for _ in range(n)], [[] for _ in range(n)]
    job.finish, job.stop_reason = [None] * n, [None] * n


def _resolve(job: Job) -> None:
    if not job.future.done():
        job.future.set_result(job.result())


def _fail(job: Job, err: BaseException) -> None:
    if not job.future.done():
        job.future.set_exception(err)
