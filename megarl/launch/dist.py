"""torch.distributed start-up from the launcher's environment, with timeouts and errors that name rank and
host.

The launcher sets MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK and MEGARL_DIST_TIMEOUT_S /
MEGARL_DIST_BACKEND; learner programs call ``init_from_env()`` and wrap collectives in ``named_errors()``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist


class DistributedError(RuntimeError):
    """A collective or the rendezvous failed; the message starts with 'rank R/W on HOST'."""


@dataclass(frozen=True)
class DistContext:
    """This process's place in the learner world."""

    rank: int
    world_size: int
    local_rank: int
    host: str
    backend: str
    timeout_s: float

    def where(self) -> str:
        return f"rank {self.rank}/{self.world_size} (local {self.local_rank}) on {self.host}"


def _env_int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except KeyError:
        raise DistributedError(
            f"{key} is not set: start learner ranks with python -m megarl.launch"
        ) from None


def context_from_env(env: Mapping[str, str] | None = None) -> DistContext:
    """Read rank, world size, host, backend and timeout without initialising anything."""
    env = os.environ if env is None else env
    backend = env.get("MEGARL_DIST_BACKEND", "auto")
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    return DistContext(
        rank=_env_int(env, "RANK"),
        world_size=_env_int(env, "WORLD_SIZE"),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        host=env.get("MEGARL_NODE") or socket.gethostname(),
        backend=backend,
        timeout_s=float(env.get("MEGARL_DIST_TIMEOUT_S", 1800)),
    )


@contextlib.contextmanager
def named_errors(ctx: DistContext, what: str) -> Iterator[None]:
    """Re-raise any error inside the block as DistributedError naming ``what``, the rank and the host."""
    try:
        yield
    except DistributedError:
        raise
    except Exception as exc:  # gloo/NCCL raise RuntimeError subclasses with long messages
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DistributedError(
            f"{ctx.where()}: {what} failed (timeout {ctx.timeout_s:.0f}s, backend "
            f"{ctx.backend}): {type(exc).__name__}: {first}"
        ) from exc


def init_from_env(env: Mapping[str, str] | None = None) -> DistContext:
    """Initialise the default process group from the launcher's variables; errors name rank and host."""
    ctx = context_from_env(env)
    if ctx.backend == "nccl":
        torch.cuda.set_device(ctx.local_rank)
    with named_errors(
        ctx, f"init_process_group with {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    ):
        dist.init_process_group(
            backend=ctx.backend,
            rank=ctx.rank,
            world_size=ctx.world_size,
            timeout=datetime.timedelta(seconds=ctx.timeout_s),
        )
    return ctx
