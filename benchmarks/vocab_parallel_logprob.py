"""Peak extra memory and time: megarl's chunked vocab-parallel logprob + entropy vs naive torch.

Naive baseline (measured in the same run): log_softmax over the full fp32 logits [T, V], gather
the target, entropy = -Σ p log p, backward through autograd. megarl: vocab_parallel_logprobs_entropy
at TP=1 and TP=2 (two gloo processes, each holding [T, V/2]). Logits are given (no hidden size).
Each variant runs in a fresh process; "extra" = peak RSS during the op minus RSS once the logits
exist, so the logits themselves are not counted. Prints ratios against the naive baseline.

    python benchmarks/vocab_parallel_logprob.py [--tokens 8192] [--vocab 151936]
Targets: extra memory <= 1/4 of naive, time <= 1.5x naive.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rss_now_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRss:
    """Samples this process's RSS every millisecond in a thread; ``peak`` is the largest seen."""

    def __init__(self):
        self.peak, self._stop = _rss_now_bytes(), threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_now_bytes())
            time.sleep(0.001)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss_now_bytes())


def _variant(name: str, T: int, V: int, rank: int, world: int, port: int, backward: bool, q) -> None:
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    group = None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        group = dist.group.WORLD
    shard = V // world
    logits = torch.empty(T, shard).uniform_(-8, 8)
    targets = torch.randint(0, V, (T,))
    from megarl.ops.vocab_parallel import vocab_parallel_logprobs_entropy

    base = _rss_now_bytes()
    with _PeakRss() as rss:
        t0 = time.perf_counter()
        x = logits.requires_grad_(backward)
        if name == "naive":
            logp = torch.log_softmax(x, -1)
            lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            ent = -(logp.exp() * logp).sum(-1)
        else:
            lp, ent = vocab_parallel_logprobs_entropy(
                x, targets, group, inplace_backward=(name == "megarl-inplace")
            )
        if backward:
            (lp.sum() + 0.1 * ent.sum()).backward()
        elapsed = time.perf_counter() - t0
    q.put((rank, {"time_s": elapsed, "extra_gib": (rss.peak - base) / 2**30}))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def run(name: str, T: int, V: int, world: int, backward: bool) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        ctx.Process(target=_variant, args=(name, T, V, r, world, port, backward, q)) for r in range(world)
    ]
    for p in procs:
        p.start()
    res = [q.get() for _ in procs]
    for p in procs:
        p.join()
    per_rank = [r for _, r in sorted(res)]
    return {"time_s": max(r["time_s"] for r in per_rank), "extra_gib": max(r["extra_gib"] for r in per_rank)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument(
        "--backward-tokens",
        type=int,
        default=None,
        help="T for the forward+backward rows (default: --tokens). The naive backward at T=8192, "
        "V=151936 needs ~25 GiB besides the logits: more than a 24 GiB machine has.",
    )
    args = ap.parse_args()
    V = args.vocab
    rows = []
    for backward in (False, True):
        T = args.backward_tokens if (backward and args.backward_tokens) else args.tokens
        print(
            f"{'forward+backward' if backward else 'forward only'}: T={T} V={V}, "
            f"fp32 logits {T * V * 4 / 2**30:.2f} GiB (not counted)"
        )
        phase = "forward+backward" if backward else "forward only"
        naive = run("naive", T, V, 1, backward)
        rows.append((phase, "naive torch log_softmax (TP=1)", naive, naive))
        variants = [("megarl", 1), ("megarl", 2)] + (
            [("megarl-inplace", 1), ("megarl-inplace", 2)] if backward else []
        )
        for name, world in variants:
            rows.append((phase, f"{name} TP={world} (per rank)", run(name, T, V, world, backward), naive))
    print(
        f"{'phase':<17} {'variant':<34} {'time s':>8} {'extra GiB':>10} {'time ratio':>11} {'mem ratio':>10}"
    )
    out = []
    for phase, label, r, base in rows:
        tr = r["time_s"] / base["time_s"]
        mr = r["extra_gib"] / base["extra_gib"] if base["extra_gib"] > 0 else float("nan")
        print(f"{phase:<17} {label:<34} {r['time_s']:>8.2f} {r['extra_gib']:>10.3f} {tr:>11.2f} {mr:>10.3f}")
        out.append({"phase": phase, "variant": label, **r, "time_ratio": tr, "mem_ratio": mr})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
