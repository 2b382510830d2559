"""Packed attention on CPU: per-sequence (varlen) vs the dense block-diagonal ``[T, T]`` mask.

    .venv/bin/python benchmarks/varlen_attention.py                  # packs of 2..16 x 512 tokens
    .venv/bin/python benchmarks/varlen_attention.py --seq-len 512 --max-seqs 8 --layers 1

One megatron-core GPTModel (local spec, the CPU path of ``megarl train``) of the step-speed
benchmark's shape (hidden 128, 4 heads / 2 KV heads of 32), ``--layers`` layers, fp32, one torch
thread by default. For packs of 2, 4, ..., ``--max-seqs`` sequences of ``--seq-len`` tokens it
times forward + backward of a summed logprob with ``packed_inputs(attention='dense')`` and
``attention='varlen'`` (best of ``--repeats``), and prints both, the ratio, and the largest
difference of the logprobs between the two paths.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def hf_config(layers: int, vocab: int) -> dict:
    """The step-speed benchmark's Qwen3 shape with ``layers`` layers."""
    return dict(
        model_type="qwen3",
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )


def fwd_bwd(model, tokens: torch.Tensor, cu: torch.Tensor, attention: str) -> tuple[float, torch.Tensor]:
    """Seconds for one forward + backward of the packed row; the logprobs of the tokens."""
    from megarl.learner.forward import packed_inputs, run_model

    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    logits = run_model(model, packed_inputs(tokens, cu, torch.device("cpu"), attention=attention))
    lp = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    lp.sum().backward()
    return time.perf_counter() - t0, lp.detach()


def main() -> None:
    """Time both paths for each pack length and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--max-seqs", type=int, default=16)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from megarl.learner.model import build_gpt_model
    from megarl.learner.parallel import ParallelLayout, initialize_parallel

    model = build_gpt_model(hf_config(args.layers, 32), initialize_parallel(ParallelLayout()))
    print(
        f"{args.layers} layer(s), hidden 128, 4 heads, fp32, {args.threads} thread(s), "
        f"load average {os.getloadavg()[0]:.1f} at start"
    )
    print(f"{'sequences x len':>16} {'T':>6} {'dense s':>9} {'varlen s':>9} {'ratio':>7} {'max |dlogp|':>12}")
    n = 2
    while n <= args.max_seqs:
        T = n * args.seq_len
        cu = torch.arange(n + 1) * args.seq_len
        tokens = torch.randint(0, 32, (T,), generator=torch.Generator().manual_seed(n))
        best = {}
        lps = {}
        for attention in ("dense", "varlen"):
            times = []
            for _ in range(args.repeats):
                t, lps[attention] = fwd_bwd(model, tokens, cu, attention)
                times.append(t)
            best[attention] = min(times)
        diff = float((lps["dense"] - lps["varlen"]).abs().max())
        print(
            f"{f'{n} x {args.seq_len}':>16} {T:>6} {best['dense']:>9.3f} {best['varlen']:>9.3f} "
            f"{best['dense'] / best['varlen']:>6.1f}x {diff:>12.2e}"
        )
        n *= 2


if __name__ == "__main__":
    main()
