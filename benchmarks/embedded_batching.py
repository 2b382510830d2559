"""The embedded engine: continuous batching across prompts vs one request at a time.

    .venv/bin/python benchmarks/embedded_batching.py                       # 16 prompts x 8 samples
    .venv/bin/python benchmarks/embedded_batching.py --prompts 32 --max-new-tokens 16

The quickstart's policy shape (examples/quickstart.yaml: its Qwen3 config and char tokenizer, random
weights drawn with ``--seed``), ``--prompts`` prompts of its task (reverse a 3-digit string) with
``n`` samples each and its sampling settings (temperature 1, stop at <eos>, ``max_new_tokens`` 8),
one seed per prompt. All prompts are sent at once, as the collector does, to two engines on the
same model: ``max_batch_rows=1`` (each request decodes alone, the engine before continuous
batching) and the default (every request in one batch). Each is timed over ``--repeats`` rounds
(best kept, default 10); it prints generated tokens per second of both, the ratio, how many samples are
token-for-token identical between the two and the largest logprob difference over those.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "examples/quickstart.yaml"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the config's")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = load_config(a.config)
    tok, hf = tokenizer_and_hf_config(cfg)
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


if __name__ == "__main__":
    main()
