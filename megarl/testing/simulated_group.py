"""Tensor parallelism simulated in one process: each rank is a thread, collectives meet at a barrier.

Used by the property tests (fast, never hangs, clean hypothesis shrinking). Stricter than gloo
about ordering: every collective call index must have the same (op, shape, dtype) on all ranks,
and a rank that issues fewer collectives than the others is reported by a final "finish" check.
It does not exercise the real transport: megarl.testing.gloo_pool does that.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class CollectiveMismatch(RuntimeError):
    """Ranks issued different collectives at the same call index."""


class SimulatedGroup:
    """One rank's handle on a SimulatedWorld; quacks like a process group for megarl.ops.comm."""

    def __init__(self, world: SimulatedWorld, rank: int):
        self._world, self._rank, self.calls = world, rank, 0

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._world.n

    def _exchange(self, sig: tuple, t: torch.Tensor | None) -> list:
        w = self._world
        w.slots[self._rank] = (sig, None if t is None else t.detach().clone())
        w.barrier.wait()
        sigs = [s for s, _ in w.slots]
        if any(s != sigs[0] for s in sigs):
            desc = ", ".join(f"rank {r}: {s}" for r, s in enumerate(sigs))
            raise CollectiveMismatch(f"collective #{self.calls} differs across ranks: {desc}")
        vals = [v for _, v in w.slots]
        w.barrier.wait()  # nobody may overwrite a slot before every rank has read them all
        self.calls += 1
        return vals

    def sim_all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        vals = self._exchange(("all_reduce", op, tuple(t.shape), t.dtype), t)
        red = {"sum": lambda a, b: a + b, "max": torch.maximum, "min": torch.minimum}[op]
        out = vals[0]
        for v in vals[1:]:
            out = red(out, v)
        with torch.no_grad():
            t.copy_(out)
        return t

    def sim_all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return self._exchange(("all_gather", tuple(t.shape), t.dtype), t)

    def finish(self) -> None:
        self._exchange(("finish",), None)


class SimulatedWorld:
    """n ranks as threads. ``run(fn)`` calls ``fn(rank, group)`` on every rank and returns the
    results in rank order, or raises the lowest rank's real error."""

    def __init__(self, n: int, timeout_s: float = 30.0):
        self.n = n
        self.timeout_s = timeout_s

    def run(self, fn: Callable[[int, SimulatedGroup], Any]) -> list[Any]:
        self.barrier = threading.Barrier(self.n, timeout=self.timeout_s)
        self.slots: list = [None] * self.n
        results: list = [None] * self.n
        errors: list = [None] * self.n

        def body(r: int) -> None:
            g = SimulatedGroup(self, r)
            try:
                results[r] = fn(r, g)
                g.finish()
            except BaseException as e:
                errors[r] = e
                self.barrier.abort()

        if self.n == 1:
            body(0)
        else:
            threads = [threading.Thread(target=body, args=(r,)) for r in range(self.n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
        if real:
            raise real[0]
        if any(e is not None for e in errors):
            raise CollectiveMismatch("a rank left the collectives early (barrier broken)")
        return results
