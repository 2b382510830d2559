"""SpecRoll speed-up on the embedded engine: accepted tokens per target forward and wall time.

    python benchmarks/specroll_bench.py --config examples/quickstart.yaml --weights runs/sr-base/init_policy

Builds the config's policy (from ``--weights``, an HF directory such as a run's ``init_policy``, or
random weights), then for the same prompts and seeds generates ``--n`` samples per prompt three
ways: the plain decode loop, SpecRoll with untrained heads (zero init: each head guesses the
next-token distribution), and SpecRoll after the slow path trained the heads on the samples of
``--train-prompts`` other prompts. Reports, per way: target forwards per sample (the plain loop:
one per generated token, its ``n`` samples batched), tokens per target forward, the draft
acceptance rate, and wall time. The plain loop batches a request's ``n`` samples in one forward;
SpecRoll verifies one sample at a time, so its wall time pays for that.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch

from megarl.methods.allocation.specroll import SpecRollKnobs, SpecRollPart
from megarl.rollout.embedded import EmbeddedEngine, hf_model_from_config
from megarl.rollout.types import SamplingParams
from megarl.trainer.config import load_config
from megarl.trainer.setup import load_datasets, tokenizer_and_hf_config


def generate(engine, prompts, n, max_new, temperature, seed0) -> tuple[list, float]:
    """Every prompt's ``n`` samples (seed per prompt) and the wall time."""

    async def all_() -> list:
        out = []
        for i, p in enumerate(prompts):
            sp = SamplingParams(temperature=temperature, max_new_tokens=max_new, seed=seed0 + i)
            out.append(await engine.generate(p, n=n, sampling=sp))
        return out

    t0 = time.perf_counter()
    res = asyncio.run(all_())
    return res, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/quickstart.yaml")
    ap.add_argument("--weights", default=None, help="HF directory of the policy (default: random weights)")
    ap.add_argument("--prompts", type=int, default=32, help="measured prompts")
    ap.add_argument("--train-prompts", type=int, default=64, help="prompts whose samples train the heads")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--slow-steps", type=int, default=300)
    ap.add_argument("--slow-lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    tok, hf = tokenizer_and_hf_config(cfg)
    train_ds, _ = load_datasets(cfg, tok)
    if args.weights:
        engine = EmbeddedEngine.from_pretrained(args.weights, eos_token_ids=[tok.eos_id])
    else:
        torch.manual_seed(cfg.model.seed)
        engine = EmbeddedEngine(hf_model_from_config(hf), eos_token_ids=[tok.eos_id])
    rows = train_ds.rows
    measured = [tok.encode(r.prompt) for r in rows[: args.prompts]]
    heldin = [tok.encode(r.prompt) for r in rows[args.prompts : args.prompts + args.train_prompts]]
    r = cfg.rollout
    gen = lambda ps, seed: generate(engine, ps, args.n, r.max_new_tokens, r.temperature, seed)  # noqa: E731

    report = {}
    res, wall = gen(measured, 1000)
    toks = sum(len(s.token_ids) for g in res for s in g.samples)
    fwd = sum(max(len(s.token_ids) for s in g.samples) for g in res)  # batched: one per step of the longest
    report["plain"] = {
        "tokens": toks,
        "forwards_per_sample": fwd / len(measured),
        "tokens_per_forward": toks / (fwd * args.n),
        "wall_s": round(wall, 3),
    }
    knobs = SpecRollKnobs(
        depth=args.depth, width=args.width, slow_steps=args.slow_steps, slow_lr=args.slow_lr
    )
    part = SpecRollPart(engine, knobs)
    for label in ("specroll_untrained", "specroll_trained"):
        if label == "specroll_trained":
            part.decoder.buffer.clear()
            gen(heldin, 5000)  # fills the slow path's buffer with the policy's own samples
            w_u = engine.model.get_output_embeddings().weight
            loss = part.decoder.train_heads(w_u)
            report["head_loss_after_training"] = round(loss, 4)
        part.decoder.take_stats()
        res, wall = gen(measured, 1000)
        st = part.decoder.take_stats()
        report[label] = {
            "tokens": st["tokens"],
            "forwards_per_sample": st["forwards"] / st["samples"],
            "tokens_per_forward": st["tokens"] / st["forwards"],
            "accept_rate": st["accepted"] / max(st["drafted"], 1),
            "accepted_per_round": st["accepted"] / max(st["rounds"], 1),
            "wall_s": round(wall, 3),
        }
    part.close()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
