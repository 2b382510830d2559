"""A persistent pool of real gloo ranks for tests: spawned once, fed cases through pipes.

The driver (the pytest process) is not a rank: it sends each case to every worker over its own
pipe (the control plane is never a collective), every worker runs its rank's share over gloo,
and the driver gets all ranks' results back to check every shard. A worker that raises sends its
traceback and exits, so its peers fail fast ("connection closed") instead of hanging; the pool is
then torn down and respawned on the next call.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import pickle
import socket
import traceback
from datetime import timedelta
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve(path: str):
    mod, _, name = path.partition(":")
    return getattr(importlib.import_module(mod), name)


def _worker(rank: int, world: int, port: int, timeout_s: float, conn) -> None:
    import torch
    import torch.distributed as dist

    from megarl.catalogue import load_builtin

    load_builtin()  # a worker is a composition root: cases may name any built-in part
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    group = dist.group.WORLD
    while True:
        msg = conn.recv_bytes()
        if not msg:
            break
        fn_path, payload = pickle.loads(msg)
        try:
            out = _resolve(fn_path)(rank, group, payload)
            conn.send_bytes(pickle.dumps(("ok", out)))
        except BaseException:
            conn.send_bytes(pickle.dumps(("err", traceback.format_exc())))
            conn.close()
            os._exit(1)
    dist.destroy_process_group()


class WorkerError(RuntimeError):
    """A rank raised; the message holds its traceback."""


class GlooPool:
    """``world_size`` gloo ranks in spawned processes. ``run(fn_path, payload)`` calls
    ``fn(rank, group, payload)`` (fn given as 'module:function') on every rank and returns the
    results in rank order."""

    def __init__(self, world_size: int, timeout_s: float = 60.0):
        self.world_size, self.timeout_s = world_size, timeout_s
        self._procs: list = []
        self._conns: list = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        for r in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker, args=(r, self.world_size, port, self.timeout_s, child), daemon=True
            )
            p.start()
            self._procs.append(p)
            self._conns.append(parent)

    def run(self, fn_path: str, payload: Any) -> list[Any]:
        if not self._procs:
            self._start()
        msg = pickle.dumps((fn_path, payload))
        for c in self._conns:
            c.send_bytes(msg)
        results, errors = [], []
        for r, c in enumerate(self._conns):
            if not c.poll(self.timeout_s * 3):
                errors.append((r, f"rank {r} sent nothing within {self.timeout_s * 3:.0f} s"))
                results.append(None)
                continue
            try:
                status, out = pickle.loads(c.recv_bytes())
            except EOFError:
                status, out = "err", f"rank {r} died without a message"
            (results if status == "ok" else errors).append(out if status == "ok" else (r, out))
            if status != "ok":
                results.append(None)
        if errors:
            self.close()
            real = [e for e in errors if "Connection closed" not in e[1] and "died without" not in e[1]]
            r, tb = (real or errors)[0]
            raise WorkerError(f"rank {r} of {self.world_size} failed:\n{tb}")
        return results

    def close(self) -> None:
        for c in self._conns:
            try:
                c.send_bytes(b"")
            except (OSError, BrokenPipeError):
                pass
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
        self._procs, self._conns = [], []
