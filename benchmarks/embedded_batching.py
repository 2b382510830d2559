"""The embedded engine: continuous batching across prompts vs one request at a time.

    .venv/bin/python benchmarks/embedded_batching.py                       # 16 prompts x 8 samples
    .venv/bin/python benchmarks/embedded_batching.py --prompts 32 --max-new-tokens 16
    .venv/bin/python benchmarks/embedded_batching.py --layers 4 --max-new-tokens 4   # step_speed's task

The quickstart's policy shape (examples/quickstart.yaml: its Qwen3 config and char tokenizer, random
weights drawn with ``--seed``), ``--prompts`` prompts of its task (reverse a 3-digit string) with
``n`` samples each and its sampling settings (temperature 1, stop at <eos>, ``max_new_tokens`` 8),
one seed per prompt. All prompts are sent at once, as the collector does, to two engines on the
same model: ``max_batch_rows=1`` (each request decodes alone, the engine before continuous
batching) and the default (every request in one batch). Each is timed over ``--repeats`` rounds
(best kept, default 10); it prints generated tokens per second of both, the ratio, how many samples are
token-for-token identical between the two and the largest logprob difference over those.

It then times the batched engine against transformers' ``generate`` of the same prompts and
samples on the same model (``num_return_sequences=n``, sampling at the same temperature / top-k /
top-p, the same token budget; the rollout of ``benchmarks/step_speed.py``'s plain loop), alternating
the two for ``--rounds`` rounds (default 30): the median wall seconds and the mean CPU seconds of
the process per round (CPU time moves less than wall time on a shared machine), their ratio, and
the engine's prefill forwards per round.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megarl.data.tasks import TASKS
from megarl.rollout.embedded import EmbeddedEngine, hf_model_from_config
from megarl.rollout.types import SamplingParams
from megarl.trainer.config_loading import load_config
from megarl.trainer.setup import tokenizer_and_hf_config

ROOT = Path(__file__).resolve().parent.parent


async def _round(engine: EmbeddedEngine, prompts: list[list[int]], n: int, sps: list[SamplingParams]):
    return await asyncio.gather(*[engine.generate(p, n=n, sampling=sp) for p, sp in zip(prompts, sps)])


def timed(engine: EmbeddedEngine, prompts, n, sps, repeats: int) -> tuple[float, list]:
    """Best wall time of ``repeats`` rounds and the results of the last one."""
    best, results = float("inf"), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        results = asyncio.run(_round(engine, prompts, n, sps))
        best = min(best, time.perf_counter() - t0)
    return best, results


def engine_vs_generate(engine: EmbeddedEngine, tok, prompts, n: int, sps: list[SamplingParams], rounds: int):
    """Alternate rounds of the engine and of ``generate``: (median wall s, mean CPU s) of each per
    round, and the engine's prefill forwards per round."""
    model, sp = engine.model, sps[0]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[tok.pad_id] * (width - len(p)) + p for p in prompts])  # left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = {"top_k": sp.top_k} if sp.top_k > 0 else {"top_k": 0}
    loop = asyncio.new_event_loop()
    walls: dict[str, list[float]] = {"engine": [], "generate": []}
    cpus: dict[str, list[float]] = {"engine": [], "generate": []}
    prefills = 0
    for i in range(rounds + 1):  # round 0 warms both up and is not counted
        for side in ("engine", "generate"):
            before = engine._batcher.prefills
            t0, c0 = time.perf_counter(), time.process_time()
            if side == "engine":
                round_sps = [dataclasses.replace(s, seed=s.seed + 7919 * i) for s in sps]
                loop.run_until_complete(_round(engine, prompts, n, round_sps))
            else:
                with torch.no_grad():
                    model.generate(
                        ids,
                        attention_mask=mask,
                        do_sample=sp.temperature > 0,
                        temperature=sp.temperature or None,
                        top_p=sp.top_p,
                        max_new_tokens=sp.max_new_tokens,
                        num_return_sequences=n,
                        pad_token_id=tok.pad_id,
                        eos_token_id=tok.eos_id,
                        **kw,
                    )
            if i:
                walls[side].append(time.perf_counter() - t0)
                cpus[side].append(time.process_time() - c0)
                prefills += engine._batcher.prefills - before
    loop.close()
    out = {side: (statistics.median(walls[side]), statistics.mean(cpus[side])) for side in walls}
    return out, prefills / rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "examples/quickstart.yaml"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the config's")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the config's)")
    ap.add_argument("--rounds", type=int, default=30, help="rounds of the engine against generate")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = load_config(a.config)
    tok, hf = tokenizer_and_hf_config(cfg)
    if a.layers:
        hf = {**hf, "num_hidden_layers": a.layers}
    torch.manual_seed(a.seed)
    model = hf_model_from_config(hf)
    rng = random.Random(a.seed)
    gen = cfg.data.generate or {}
    task = TASKS[gen.get("task", "reverse")]
    digits = int(gen.get("digits", 3))
    prompts = [tok.encode(task(rng, digits)[0]) for _ in range(a.prompts)]
    r = cfg.rollout
    base = SamplingParams(
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=a.max_new_tokens or r.max_new_tokens,
        stop_token_ids=(tok.eos_id,),
    )
    sps = [dataclasses.replace(base, seed=1000 + i) for i in range(a.prompts)]
    alone = EmbeddedEngine(model, eos_token_ids=[tok.eos_id], max_batch_rows=1)
    batched = EmbeddedEngine(model, eos_token_ids=[tok.eos_id])
    timed(batched, prompts[:2], r.n, sps[:2], 1)  # warm-up (first-call allocations, lazy imports)
    t_alone, res_alone = timed(alone, prompts, r.n, sps, a.repeats)
    t_batch, res_batch = timed(batched, prompts, r.n, sps, a.repeats)
    pairs = [(x, y) for ra, rb in zip(res_alone, res_batch) for x, y in zip(ra.samples, rb.samples)]
    tokens = sum(len(x.token_ids) for x, _ in pairs)
    tokens_b = sum(len(y.token_ids) for _, y in pairs)
    same = [(x, y) for x, y in pairs if x.token_ids == y.token_ids]
    dlp = max((abs(p - q) for x, y in same for p, q in zip(x.logprobs, y.logprobs)), default=0.0)
    print(
        f"quickstart policy ({hf['num_hidden_layers']} layers, hidden {hf['hidden_size']}, vocab "
        f"{hf['vocab_size']}), {a.prompts} prompts x {r.n} samples, max_new_tokens "
        f"{base.max_new_tokens}, {a.threads} torch thread(s), best of {a.repeats}"
    )
    print(f"one request at a time: {tokens} tokens in {t_alone:.3f} s = {tokens / t_alone:,.0f} tokens/s")
    print(f"continuous batching:   {tokens_b} tokens in {t_batch:.3f} s = {tokens_b / t_batch:,.0f} tokens/s")
    print(f"speed-up: {(tokens_b / t_batch) / (tokens / t_alone):.2f}x")
    print(f"identical samples: {len(same)}/{len(pairs)}; largest |logprob difference| over them: {dlp:.2e}")
    if a.rounds > 0:
        fig, prefills = engine_vs_generate(batched, tok, prompts, r.n, sps, a.rounds)
        (ew, ec), (gw, gc) = fig["engine"], fig["generate"]
        print(
            f"engine vs transformers generate, {a.rounds} alternating rounds "
            "(median wall / mean CPU s per round):"
        )
        print(f"  engine:   {ew:.4f} s wall, {ec:.4f} s CPU; prefill forwards per round {prefills:.2f}")
        print(f"  generate: {gw:.4f} s wall, {gc:.4f} s CPU")
        print(f"  engine / generate: {ew / gw:.2f}x wall, {ec / gc:.2f}x CPU")


if __name__ == "__main__":
    main()
