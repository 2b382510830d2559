"""Toy-scale check of 3PO's exploration claim: how many groups have equal rewards (zero GRPO
advantage) when a group's samples come from parameter-perturbed policies, against raising the
temperature alone. Rollouts only, no training: one policy, the same prompts and sampling seeds.

    .venv/bin/python benchmarks/perturbation_claim.py --policy runs/quickstart/init_policy \\
        --config examples/quickstart.yaml --prompts 200 --n 8

``--policy``: a HF checkpoint of the config's model (a run's ``init_policy/``, the warmed-up
quickstart model). Per setting, every prompt gets a group of n samples from the embedded engine and
the config's correctness reward; a group is zero-advantage when all its rewards are equal. Settings:
temperature T alone (σ = 0); σ > 0 with one perturbation per group (K = 1: the trainer's 3PO, one θ̃
per step) and with K = 4 perturbations × n/4 samples per group (the spec's K perturbations; the
trainer does not build this; σ = 0 with K = 4 is the control: the same split into 4 sampling calls
without noise). The weights are θ + σ·ε(seed) on the HF tensors
(reference/perturbation.py: the same noise megarl's sharded perturbation makes). Prints one JSON
line per setting: zero-advantage fraction, sampled accuracy.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import torch

from megarl.rewards.compute import RewardComputer
from megarl.rollout.embedded import EmbeddedEngine
from megarl.rollout.types import SamplingParams
from megarl.trainer.config import load_config
from megarl.trainer.setup import load_datasets, tokenizer_and_hf_config
from reference.perturbation import perturb_state


async def _samples(engine, prompts, n, temperature, max_new, eos, seed0) -> list[list[list[int]]]:
    sp = [
        SamplingParams(temperature=temperature, max_new_tokens=max_new, stop_token_ids=(eos,), seed=seed0 + i)
        for i in range(len(prompts))
    ]
    res = await asyncio.gather(*[engine.generate(p, n=n, sampling=s) for p, s in zip(prompts, sp)])
    return [[x.token_ids for x in r.samples] for r in res]


def main() -> None:
    """Measure every setting and print one JSON line each."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", required=True)
    ap.add_argument("--config", default="examples/quickstart.yaml")
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--temperatures", default="1.0,1.3,1.6")
    ap.add_argument("--sigmas", default="0,0.003,0.01")  # 0: the K-split control
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(a.config)
    tok, _ = tokenizer_and_hf_config(cfg)
    rows = load_datasets(cfg, tok)[0].rows[: a.prompts]
    prompts = [tok.encode(r.prompt) for r in rows]
    rewards = RewardComputer(cfg.reward)
    engine = EmbeddedEngine.from_pretrained(a.policy, eos_token_ids=[tok.eos_id])
    base = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    loop = asyncio.new_event_loop()

    def load(state) -> None:
        loop.run_until_complete(engine.update_weights_from_tensors(state))

    def groups(parts: list[list[list[list[int]]]]) -> list[list[float]]:
        """Rewards per prompt: the samples of every part (perturbation) of a group together."""
        out = []
        for i, r in enumerate(rows):
            ids = [s for part in parts for s in part[i]]
            res = rewards([tok.decode(x) for x in ids], [r.answer] * len(ids))
            out.append(res.correct.float().tolist())
        return out

    def report(setting: dict, g: list[list[float]]) -> None:
        zero = sum(len(set(x)) == 1 for x in g) / len(g)
        acc = sum(sum(x) for x in g) / sum(len(x) for x in g)
        print(
            json.dumps({**setting, "zero_adv_frac": round(zero, 4), "sampled_acc": round(acc, 4)}), flush=True
        )

    mx = cfg.rollout.max_new_tokens
    for t in [float(x) for x in a.temperatures.split(",")]:
        load(base)
        report(
            {"T": t, "sigma": 0.0, "K": 1},
            groups([loop.run_until_complete(_samples(engine, prompts, a.n, t, mx, tok.eos_id, a.seed))]),
        )
    t0 = float(a.temperatures.split(",")[0])
    for sigma in [float(x) for x in a.sigmas.split(",")]:
        for K in (1, 4):
            parts = []
            for k in range(K):
                load(perturb_state(base, a.seed * 1000 + 17 * (k + 1), sigma))
                parts.append(
                    loop.run_until_complete(
                        _samples(engine, prompts, a.n // K, t0, mx, tok.eos_id, a.seed + 7919 * k)
                    )
                )
            report({"T": t0, "sigma": sigma, "K": K}, groups(parts))
    load(base)
    rewards.close()


if __name__ == "__main__":
    main()
