"""Launcher self-test workload: a real torch.distributed program to run under ``python -m megarl.launch``.

Every rank rendezvous through MASTER_ADDR/PORT, checks an all_reduce, reports rank and host, asks each rollout
server handed over by the launcher who it is, then trains a tiny MLP for a few steps (gradients averaged with
all_reduce), saving an atomic checkpoint every step and resuming from the newest one. SIGUSR1 / SIGTERM make
every rank stop after the next checkpoint (the ranks agree on the step with an all_reduce of the stop flag).

It checks a new cluster's launch path without a model; it is not a stand-in for any library.
"""

from __future__ import annotations

import signal

_STOP: dict[str, str | None] = {"signal": None}


def _on_signal(signum: int, _frame) -> None:
    _STOP["signal"] = signal.Signals(signum).name


# Installed before torch is imported (seconds): a pre-emption signal during start-up must not kill the rank.
signal.signal(signal.SIGUSR1, _on_signal)
signal.signal(signal.SIGTERM, _on_signal)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megarl.launch.checkpoint_dirs import commit_checkpoint, find_latest  # noqa: E402
from megarl.launch.dist import DistContext, DistributedError, init_from_env, named_errors  # noqa: E402
from megarl.launch.selftest_model import batch, digest, make_model, make_optimizer  # noqa: E402


def _say(msg: str) -> None:
    print(f"selftest: {msg}", flush=True)


def check_collectives(ctx: DistContext, hang_rank: int | None) -> None:
    """all_reduce of rank+1 must give W(W+1)/2; all ranks report their host."""
    if hang_rank == ctx.rank:
        time.sleep(ctx.timeout_s + 5)  # makes the others hit their collective timeout
    with named_errors(ctx, "all_reduce"):
        t = torch.tensor([float(ctx.rank + 1)])
        dist.all_reduce(t)
    want = ctx.world_size * (ctx.world_size + 1) / 2
    if t.item() != want:
        raise DistributedError(f"{ctx.where()}: all_reduce gave {t.item()}, expected {want}")
    hosts: list = [None] * ctx.world_size
    with named_errors(ctx, "all_gather_object"):
        dist.all_gather_object(hosts, socket.gethostname())
    if ctx.rank == 0:
        _say(f"all_reduce ok sum={t.item():.0f} world={ctx.world_size} hosts={','.join(hosts)}")


def ping_rollout(ctx: DistContext) -> None:
    """Rank 0 asks every rollout server from MEGARL_ROLLOUT_ADDRESSES who it is."""
    urls = [u for u in os.environ.get("MEGARL_ROLLOUT_ADDRESSES", "").split(",") if u]
    if ctx.rank != 0:
        return
    for url in urls:
        with urllib.request.urlopen(url + "/whoami", timeout=10) as resp:
            info = json.loads(resp.read())
        _say(f"rollout server {url} answered host={info['host']}")
    _say(f"rollout servers reached: {len(urls)}")


def train(ctx: DistContext, steps: int, step_sleep: float, ckpt_dir: Path) -> int:
    """Train, checkpoint each step, resume from the newest checkpoint; returns the last completed step."""
    model = make_model()
    opt = make_optimizer(model)
    start = 1
    latest = find_latest(ckpt_dir)
    if latest is not None:
        state = torch.load(latest[1] / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = latest[0] + 1
        if ctx.rank == 0:
            _say(f"resumed from step {latest[0]} ({latest[1]})")
    step = start - 1
    for step in range(start, steps + 1):
        x, y = batch(step, ctx.rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        with named_errors(ctx, f"gradient all_reduce at step {step}"):
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= ctx.world_size
            avg = loss.detach().clone()
            dist.all_reduce(avg)
        opt.step()
        if ctx.rank == 0:

            def write(d: Path) -> None:
                torch.save(
                    {"step": step, "model": model.state_dict(), "opt": opt.state_dict()},  # noqa: B023 (called at once)
                    d / "state.pt",
                )

            commit_checkpoint(ckpt_dir, step, write)
            _say(f"step {step} loss {avg.item() / ctx.world_size:.6f} checkpoint saved")
        time.sleep(step_sleep)
        flag = torch.tensor([1.0 if _STOP["signal"] else 0.0])
        with named_errors(ctx, f"stop-flag all_reduce at step {step}"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # also a barrier: the checkpoint is complete
        if flag.item() and step < steps:
            if ctx.rank == 0:
                _say(f"stopping after checkpoint of step {step} on request ({_STOP['signal'] or 'peer'})")
            return step
    if ctx.rank == 0:
        _say(f"done steps={steps} final_loss={avg.item() / ctx.world_size:.6f} digest={digest(model)}")
    return step


def main(argv: list[str] | None = None) -> int:
    """Run the self-test; exit 1 with a message naming rank and host on a distributed error."""
    p = argparse.ArgumentParser(prog="python -m megarl.launch.selftest")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--step-sleep", type=float, default=0.0, help="seconds per step (to leave time for signals)"
    )
    p.add_argument("--ckpt-dir", default=os.environ.get("MEGARL_CHECKPOINT_DIR"))
    p.add_argument("--hang-rank", type=int, default=None, help="this rank skips the first collective (test)")
    args = p.parse_args(argv)
    if not args.ckpt_dir:
        p.error("--ckpt-dir or MEGARL_CHECKPOINT_DIR is required")
    try:
        ctx = init_from_env()
        print(
            f"selftest: rank={ctx.rank} local_rank={ctx.local_rank} world={ctx.world_size} "
            f"host={socket.gethostname()} node={ctx.host} master={os.environ.get('MASTER_ADDR')}:"
            f"{os.environ.get('MASTER_PORT')} backend={ctx.backend}",
            flush=True,
        )
        check_collectives(ctx, args.hang_rank)
        ping_rollout(ctx)
        train(ctx, args.steps, args.step_sleep, Path(args.ckpt_dir))
    except DistributedError as exc:
        print(f"selftest: ERROR {exc}", file=sys.stderr, flush=True)
        os._exit(1)  # skip process-group teardown, which can block on the dead peer
    # All ranks tear down together: a rank that destroys its gloo group while rank 0 (the store's host)
    # is already gone can abort at exit ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
