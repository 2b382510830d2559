"""Proxy-model benchmark on CPU: memory and step time of a pruned proxy vs its original MoE.

    .venv/bin/python benchmarks/proxy_prune.py            # prints one table with ratios

One run builds a tiny random Qwen3-MoE (32 experts, top-2, 4 layers, hidden 128, expert width 128,
the tiny-qwen3 fixture's tokenizer), prunes it with ``megarl proxy prune`` to E/4 = 8 and
E/8 = 4 experts (agglomerative, 4096 calibration tokens), then measures each of the three models in
its own process (peak RSS only grows within a process): parameter bytes, peak RSS of a training
step (forward, backward, AdamW update; transformers, float32, one thread, batch 8 x 128 random
tokens) minus the RSS right before the model is loaded, and the median step time after one
warm-up step (fastest of 2 interleaved rounds, the machine is shared). ``dev-s x`` estimates
accelerator-seconds per step: devices needed (proportional to parameter + optimizer bytes, the
memory that decides how many accelerators a run needs) x step time. Parameter and FLOP ratios come from the
prune report (FLOPs: forward matmul FLOPs per token, see megarl/proxy/report.py). Ratios are proxy / original,
measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

NUM_EXPERTS = 32
MODEL_KW = {
    "num_experts": NUM_EXPERTS,
    "top_k": 2,
    "layers": 4,
    "hidden_size": 128,
    "moe_intermediate_size": 128,
    "intermediate_size": 256,
    "head_dim": 32,
}


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _rss_now_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def measure(model_dir: str, steps: int, batch: int, seq: int) -> dict:
    """Parameter bytes, peak RSS increase of training steps, median step time of ``model_dir``."""
    import gc

    import torch
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401 (imported before the baseline)
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    gc.collect()
    base = _rss_now_mib()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:  # the first step is a warm-up
            times.append(time.perf_counter() - t0)
    return {
        "param_bytes": param_bytes,
        "peak_rss_mib": round(_peak_rss_mib() - base, 1),
        "step_s": round(min(times), 4),
        "step_median_s": round(statistics.median(times), 4),
        "loss": float(loss),
    }


def _measure_in_subprocess(model_dir: str, steps: int, batch: int, seq: int) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--measure",
        model_dir,
        "--steps",
        str(steps),
        "--batch",
        str(batch),
        "--seq",
        str(seq),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.steps, args.batch, args.seq)))
        return

    from megarl.proxy.prune import prune_moe_checkpoint
    from tests.proxy.helpers import CALIB_TEXTS, build_tiny_moe

    with tempfile.TemporaryDirectory() as tmp:
        orig = build_tiny_moe(os.path.join(tmp, "orig"), "qwen3_moe", **MODEL_KW)
        rows = {"original": {"dir": str(orig), "experts": NUM_EXPERTS}}
        calib = [f"{t} ({i})" for i in range(40) for t in CALIB_TEXTS]
        for div in (4, 8):
            e = NUM_EXPERTS // div
            t0 = time.perf_counter()
            rep = prune_moe_checkpoint(orig, os.path.join(tmp, f"proxy{e}"), e, calib, ep_size=1)
            rows[f"E/{div}"] = {
                "dir": rep["output"],
                "experts": e,
                "prune_s": round(time.perf_counter() - t0, 2),
                "calib_tokens": rep["calibration"]["tokens"],
                "param_ratio": rep["params_flops"]["total_params"]["ratio"],
                "flop_ratio": rep["params_flops"]["forward_matmul_flops_per_token"]["ratio"],
                "mass_covered": rep["coverage_mean"]["routing_mass_covered"],
                "tokens_fully_covered": rep["coverage_mean"]["tokens_fully_covered"],
            }
        for _ in range(args.rounds):  # interleaved rounds; the fastest step of all rounds counts
            for row in rows.values():
                m = _measure_in_subprocess(row["dir"], args.steps, args.batch, args.seq)
                if "step_s" in row:
                    m["step_s"] = min(m["step_s"], row["step_s"])
                    m["peak_rss_mib"] = max(m["peak_rss_mib"], row["peak_rss_mib"])
                row.update(m)
    base = rows["original"]
    print(
        f"tiny Qwen3-MoE {NUM_EXPERTS} experts top-2, 4 layers, hidden 128; step = fwd+bwd+AdamW, "
        f"batch {args.batch}x{args.seq}, 1 thread, fastest of {args.rounds} x {args.steps} steps"
    )
    hdr = (
        f"{'model':<9} {'E':>3} {'param MiB':>9} {'param x':>7} {'FLOP/tok x':>10} {'peak RSS MiB':>12} "
        f"{'RSS x':>6} {'step s':>7} {'step x':>6} {'dev-s x':>7} {'mass cov':>8} {'tok cov':>7}"
    )
    print(hdr)
    for name, r in rows.items():
        print(
            f"{name:<9} {r['experts']:>3} {r['param_bytes'] / 2**20:>9.2f} "
            f"{r['param_bytes'] / base['param_bytes']:>7.3f} {r.get('flop_ratio', 1.0):>10.3f} "
            f"{r['peak_rss_mib']:>12.1f} {r['peak_rss_mib'] / base['peak_rss_mib']:>6.3f} "
            f"{r['step_s']:>7.4f} "
            f"{r['step_s'] / base['step_s']:>6.3f} "
            f"{r['param_bytes'] / base['param_bytes'] * r['step_s'] / base['step_s']:>7.3f} "
            f"{r.get('mass_covered', 1.0):>8.3f} "
            f"{r.get('tokens_fully_covered', 1.0):>7.3f}"
        )
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "dir"} for k, v in rows.items()}))


if __name__ == "__main__":
    main()
