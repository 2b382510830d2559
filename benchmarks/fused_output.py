"""Peak extra memory and time of the training output layer: fused vs today's path vs naive.

One forward + backward of ``loss = Σ_t a_t·logp_t + b_t·H_t`` from final hidden states
``hidden [T, H]`` and the output weight ``weight [V, H]`` (fp32, CPU, TP=1), gradients to both:

- naive: ``logits = hidden @ weight.T``, aligned, ``log_softmax``, gather, ``-Σ p log p``, plain
  autograd;
- today: the learner's unfused path: the output layer's ``[T, V]`` logits, ``align_logits`` (the
  shift to the batch's alignment), then the chunked vocab-parallel op
  (megarl.ops.vocab_parallel.vocab_parallel_logprobs_entropy);
- fused: the learner's fused path: the hidden states aligned, then
  megarl.ops.fused_output.fused_logprobs_entropy (logits only per chunk, recomputed in backward).
The T tokens are packed sequences of 512 tokens.

Each variant runs in a fresh process (``--repeats N``: N alternated runs each, reporting the
fastest time and the largest memory, against the noise of a shared machine).
"extra" = peak RSS during forward+backward minus RSS once hidden, weight and targets exist,
minus the two gradients every variant must return (``[T, H]`` and ``[V, H]``): the memory the
output layer costs beyond its inputs and outputs. A variant whose estimated peak RSS exceeds the
memory available now (less ``--margin-gib``) or ``--max-gib`` is skipped and says why; one whose
RSS passes ``--max-gib`` while running is stopped and reported as such.
Times: wall clock and the process's CPU time (user + system, all threads), the steadier of the
two on a machine shared with other jobs. Targets: fused extra <= 0.1 x one [T, V] fp32 tensor;
fused time <= 1.2 x today's.

    python benchmarks/fused_output.py            # T = 8192 and 32768, H = 2048, V = 151936
    python benchmarks/fused_output.py --quick    # T = 1024 and 4096, H = 512, V = 151936
    python benchmarks/fused_output.py --tokens 8192,2048,4096 --max-gib 12   # H = 2048, what fits 12 GiB

Each variant's line ends with its peak RSS, the load average (1 min) at its start and the token
chunk of the megarl ops.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = 2**30
SEQ_LEN = 512  # the T tokens are packed sequences of this length (alignment shifts inside each)
# [T, V] fp32 tensors alive at the peak (estimate, for skipping what cannot fit)
TV_COPIES = {"naive": 5.0, "today": 3.2, "fused": 0.0}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class _PeakRss:
    """Samples this process's RSS every millisecond in a thread; ``peak`` is the largest seen.
    Past ``limit`` bytes (0: none) it reports through ``q`` and ends the process."""

    def __init__(self, limit: int = 0, q=None):
        self.peak, self._stop = _rss(), threading.Event()
        self.limit, self.q = limit, q
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            if self.limit and self.peak > self.limit and self.q is not None:
                self.q.put({"skipped": f"stopped: RSS {self.peak / GIB:.1f} GiB passed --max-gib"})
                time.sleep(0.5)  # let the queue's feeder thread send it
                os._exit(3)
            time.sleep(0.001)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())


def _variant(name: str, T: int, H: int, V: int, chunk: int | None, threads: int, limit: int, q) -> None:
    import torch

    from megarl.learner.forward import align_logits
    from megarl.ops.fused_output import fused_logprobs_entropy
    from megarl.ops.vocab_parallel import CHUNK_ELEMENTS, vocab_parallel_logprobs_entropy

    if threads:
        torch.set_num_threads(threads)

    def step(hidden, weight, targets, cu):
        if name == "naive":
            logp = torch.log_softmax(align_logits(hidden @ weight.T, cu), -1)
            lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            ent = -(logp.exp() * logp).sum(-1)
        elif name == "today":
            lp, ent = vocab_parallel_logprobs_entropy(
                align_logits(hidden @ weight.T, cu), targets, None, chunk
            )
        else:
            lp, ent = fused_logprobs_entropy(align_logits(hidden, cu), weight, targets, None, chunk)
        return lp, ent

    # warm-up on a tiny problem: lazy library state (BLAS buffers, autograd threads) is not "extra"
    w = torch.randn(64, H, requires_grad=True)
    x = torch.randn(16, H, requires_grad=True)
    lp, ent = step(x, w, torch.randint(0, 64, (16,)), torch.tensor([0, 16]))
    (lp + ent).sum().backward()
    del w, x, lp, ent
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(T, H, generator=g) * 0.5).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * H**-0.5).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g)
    a, b = torch.randn(T, generator=g), torch.randn(T, generator=g) * 0.1
    cu = torch.arange(0, T + 1, SEQ_LEN) if T % SEQ_LEN == 0 else torch.tensor([0, T])
    base = _rss()
    with _PeakRss(limit, q) as rss:
        t0, c0 = time.perf_counter(), time.process_time()
        lp, ent = step(hidden, weight, targets, cu)
        t_fwd = time.perf_counter() - t0
        (a * lp + b * ent).sum().backward()
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - c0
    grads = (hidden.numel() + weight.numel()) * 4  # the two gradients, shaped as their tensors
    q.put(
        {
            "time_s": elapsed,
            "cpu_s": cpu,
            "forward_s": t_fwd,
            "extra_gib": (rss.peak - base - grads) / GIB,
            "logp_sum": float(lp.detach().double().sum()),
            "peak_rss_gib": rss.peak / GIB,
            "chunk": min(chunk or max(CHUNK_ELEMENTS // V, 1), T),
        }
    )


def peak_estimate(name: str, T: int, H: int, V: int) -> float:
    """Estimated peak RSS of one variant's process in bytes: the [T, V] fp32 copies alive at its
    peak, hidden states, weight and their gradients (the aligned hidden copy and its gradient for
    the fused path), plus 1 GiB for torch itself and the fused path's temporaries."""
    inputs = 2 * (T * H + V * H) + (2 * T * H if name == "fused" else 0)
    return (TV_COPIES[name] * T * V + inputs) * 4 + GIB


def run(
    name: str,
    T: int,
    H: int,
    V: int,
    chunk: int | None,
    threads: int,
    margin_gib: float,
    max_gib: float,
) -> dict:
    """One variant in a fresh process, or ``{"skipped": why}`` when it cannot fit now."""
    need = peak_estimate(name, T, H, V)
    avail = _available() - margin_gib * GIB  # leave room for the other processes on the machine
    if need > avail:
        return {
            "skipped": f"needs ~{need / GIB:.1f} GiB, {avail / GIB:.1f} GiB available "
            f"(margin {margin_gib} GiB)"
        }
    if max_gib and need > max_gib * GIB:
        return {"skipped": f"needs ~{need / GIB:.1f} GiB, more than --max-gib {max_gib}"}
    load = os.getloadavg()[0]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    limit = int(max_gib * GIB) if max_gib else 0
    p = ctx.Process(target=_variant, args=(name, T, H, V, chunk, threads, limit, q))
    p.start()
    res: dict[str, object]
    while True:
        try:
            res = q.get(timeout=5)
            break
        except queue.Empty:
            if not p.is_alive():
                res = {"skipped": f"the process died (exit code {p.exitcode})"}
                break
    p.join()
    res["load_1min"] = load
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T = 1024 and 4096, H = 512 (minutes, not hours)")
    ap.add_argument("--tokens", type=str, default=None, help="comma-separated T values")
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument(
        "--chunk",
        type=int,
        default=None,
        help="token chunk of both megarl ops (default: ~2**24 logits)",
    )
    ap.add_argument("--variants", type=str, default="naive,today,fused")
    ap.add_argument(
        "--repeats", type=int, default=1, help="runs per variant, alternated (min time, max memory)"
    )
    ap.add_argument(
        "--margin-gib", type=float, default=3.0, help="memory left to others when deciding to skip"
    )
    ap.add_argument(
        "--max-gib",
        type=float,
        default=0.0,
        help="skip a variant whose estimated peak RSS exceeds this, stop one that passes it (0: no cap)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads per variant (0: torch's default)")
    args = ap.parse_args()
    tokens = [int(t) for t in (args.tokens or ("1024,4096" if args.quick else "8192,32768")).split(",")]
    H = args.hidden or (512 if args.quick else 2048)
    V = args.vocab
    names = args.variants.split(",")
    out = []
    head = f"{'T':>6} {'variant':<6} {'time s':>8} {'cpu s':>7} {'fwd s':>7} {'extra GiB':>10} {'x[T,V]':>7}"
    print(
        f"{head} {'vs today: time/cpu/mem':>26} {'vs naive: time/cpu/mem':>26}"
        f" {'rss GiB':>8} {'load':>5} {'chunk':>5}"
    )
    for T in tokens:
        tv = T * V * 4 / GIB
        res: dict[str, dict] = {}
        for _ in range(args.repeats):  # alternate the variants; keep the fastest time, the largest memory
            for n in names:
                r = run(n, T, H, V, args.chunk, args.threads, args.margin_gib, args.max_gib)
                prev = res.get(n)
                if prev is None or "skipped" in r:
                    res[n] = r
                elif "skipped" not in prev:
                    prev["extra_gib"] = max(prev["extra_gib"], r["extra_gib"])
                    prev["time_s"] = min(prev["time_s"], r["time_s"])
                    prev["cpu_s"] = min(prev["cpu_s"], r["cpu_s"])
                    prev["forward_s"] = min(prev["forward_s"], r["forward_s"])
                    prev["load_1min"] = max(prev["load_1min"], r["load_1min"])
        for n in names:
            r = res[n]
            if "skipped" in r:
                print(f"{T:>6} {n:<6} skipped: {r['skipped']}")
                out.append({"T": T, "H": H, "V": V, "variant": n, **r})
                continue
            cmp = {}
            for other in ("today", "naive"):
                o = res.get(other)
                if o and "skipped" not in o and other != n:
                    cmp[other] = tuple(r[x] / o[x] for x in ("time_s", "cpu_s", "extra_gib"))
            cols = [
                f"{cmp[k][0]:.2f}x / {cmp[k][1]:.2f}x / {cmp[k][2]:.3f}x" if k in cmp else "-"
                for k in ("today", "naive")
            ]
            print(
                f"{T:>6} {n:<6} {r['time_s']:>8.1f} {r['cpu_s']:>7.1f} {r['forward_s']:>7.1f} "
                f"{r['extra_gib']:>10.3f} {r['extra_gib'] / tv:>7.3f} {cols[0]:>26} {cols[1]:>26}"
                f" {r['peak_rss_gib']:>8.2f} {r['load_1min']:>5.1f} {r['chunk']:>5}"
            )
            out.append({"T": T, "H": H, "V": V, "variant": n, "tv_gib": tv, **r, "ratios": cmp})
        f = res.get("fused", {})
        if "skipped" not in f and "extra_gib" in f:
            t = res.get("today", {})
            time_ok = "time_s" in t and f["time_s"] <= 1.2 * t["time_s"]
            print(
                f"{T:>6} targets: fused extra {f['extra_gib'] / tv:.3f} x [T,V] (<= 0.1: "
                f"{f['extra_gib'] / tv <= 0.1}); fused time vs today "
                + (
                    f"{f['time_s'] / t['time_s']:.2f}x wall, {f['cpu_s'] / t['cpu_s']:.2f}x CPU "
                    f"(wall <= 1.2: {time_ok})"
                    if "time_s" in t
                    else "n/a (today skipped)"
                )
            )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
