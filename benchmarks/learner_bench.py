"""Learner benchmark on CPU (gloo, 2 processes): step time and peak memory per layout, and the
logprob pass's peak memory with vocab-parallel ops vs gathering the logits.

    .venv/bin/python benchmarks/learner_bench.py            # prints two tables with ratios

Each measurement is its own torchrun launch (peak RSS is per process and only grows), 2 ranks:
- step: tiny Qwen3-MoE (hidden 128, 4 layers, 8 experts top-2, vocab 4096), random weights,
  packed batch of 16 sequences x 128 tokens, 2 micro-batches; median of the timed steps after one
  warm-up; peak RSS = max over ranks of ru_maxrss.
- logprobs: dense model with a large vocabulary (32768), T = 2048 tokens, TP = 2; either
  ``Learner.compute_logprobs`` (logits stay [T, V/2] per rank) or the same forward followed by an
  all-gather to [T, V] and a full log_softmax (what a non-vocab-parallel implementation does).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MOE_CFG = dict(
    model_type="qwen3_moe",
    vocab_size=4096,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    router_aux_loss_coef=0.0,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
)
BIGVOCAB_CFG = dict(
    model_type="qwen3",
    vocab_size=32768,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
)
LAYOUTS = {"tp1": dict(), "tp2": dict(tp=2, sequence_parallel=True), "ep2": dict(ep=2)}


def _batch(vocab: int, n_seq: int, seq_len: int, seed: int = 0):
    import torch

    from megarl.batch import PackedBatch

    g = torch.Generator().manual_seed(seed)
    T = n_seq * seq_len
    cu = torch.arange(0, T + 1, seq_len)
    mask = torch.ones(T)
    mask[cu[:-1]] = 0
    return PackedBatch(
        tokens=torch.randint(0, vocab, (T,), generator=g),
        cu_seqlens=cu,
        prompt_lens=torch.ones(n_seq, dtype=torch.long),
        loss_mask=mask,
        group_ids=torch.arange(n_seq),
        advantages=torch.randn(T, generator=g),
    )


class _PG:
    """-logprob * advantage, token-mean (global)."""

    def __call__(self, logits, batch, ctx):
        from megarl.objectives.api import LossOutput
        from megarl.ops.vocab_parallel import vocab_parallel_logprobs

        lp = vocab_parallel_logprobs(logits, batch.tokens, ctx.tp_group, ctx.chunk_tokens)
        loss = -(lp * batch.advantages * batch.loss_mask).sum() / ctx.normalisers.num_tokens
        return LossOutput(loss=loss, metrics={})


def worker(mode: str, layout: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    from megarl.learner.learner import Learner, LearnerConfig, OptimConfig
    from megarl.learner.parallel import ParallelLayout, initialize_parallel

    torch.set_num_threads(1)
    if mode == "step":
        groups = initialize_parallel(ParallelLayout(**LAYOUTS[layout]))
        ln = Learner(LearnerConfig(hf_config=MOE_CFG, optim=OptimConfig(lr=1e-4)), groups)
        batch = _batch(MOE_CFG["vocab_size"], 16, 128)
        shard = batch.split(groups.dp_size)[groups.dp_rank] if groups.dp_size > 1 else batch
        times = []
        for i in range(steps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            ln.train_step(shard, _PG(), num_micro_batches=2)
            dist.barrier()
            if i:
                times.append(time.perf_counter() - t0)
        tokens_per_step = batch.num_tokens
        out = {"step_s": statistics.median(times), "tokens_per_s": tokens_per_step / statistics.median(times)}
    else:
        groups = initialize_parallel(ParallelLayout(tp=2))
        ln = Learner(LearnerConfig(hf_config=BIGVOCAB_CFG, optim=OptimConfig(lr=1e-4)), groups)
        batch = _batch(BIGVOCAB_CFG["vocab_size"], 8, 256)
        if layout == "vocab_parallel":
            _lp, _ = ln.compute_logprobs(batch, with_entropy=True)
        else:  # gather [T, V] and log_softmax it: the baseline the ops avoid
            from megarl.learner.forward import align_logits

            def loss_func(mb, logits):
                parts = [torch.empty_like(logits) for _ in range(2)]
                dist.all_gather(parts, logits.contiguous(), group=groups.tp)
                full = align_logits(torch.cat(parts, -1), mb.cu_seqlens)
                logp = torch.log_softmax(full.float(), -1)
                lp = logp.gather(-1, mb.tokens[:, None])[:, 0]
                ent = -(logp.exp() * logp).sum(-1)
                return logits.new_zeros(()), torch.tensor(1, dtype=torch.int), {"lp": lp, "ent": ent}

            with torch.no_grad():
                ln._run_schedule([batch], loss_func, forward_only=True)
        out = {}
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])  # MiB
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    out["peak_rss_mib"] = float(rss)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def launch(mode: str, layout: str, steps: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        os.path.abspath(__file__),
        "--worker",
        mode,
        "--layout",
        layout,
        "--steps",
        str(steps),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{mode}/{layout} failed:\n{p.stderr[-4000:]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--layout", default="tp1")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.layout, args.steps)
        return
    print(f"learner step, tiny Qwen3-MoE, 2 ranks on {os.cpu_count()} cores, 16x128 tokens, 2 micro-batches")
    res = {lay: launch("step", lay, args.steps) for lay in LAYOUTS}
    base = res["tp1"]
    print(
        f"{'layout':8} {'step s':>8} {'tok/s':>8} {'peak RSS MiB':>13} {'time / tp1':>11} {'RSS / tp1':>10}"
    )
    for lay, r in res.items():
        print(
            f"{lay:8} {r['step_s']:8.3f} {r['tokens_per_s']:8.0f} {r['peak_rss_mib']:13.0f} "
            f"{r['step_s'] / base['step_s']:11.2f} {r['peak_rss_mib'] / base['peak_rss_mib']:10.2f}"
        )
    print("\nlogprob pass, TP=2, vocab 32768, T=2048: peak RSS (max over ranks)")
    lp = {k: launch("logprobs", k, 0) for k in ("vocab_parallel", "gathered")}
    for k, r in lp.items():
        print(
            f"{k:15} {r['peak_rss_mib']:8.0f} MiB  "
            f"({r['peak_rss_mib'] / lp['gathered']['peak_rss_mib']:.2f} x gathered)"
        )
    print(f"(one [T, V] fp32 copy is {2048 * 32768 * 4 / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
