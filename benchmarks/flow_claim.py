"""Toy-scale claim checks of the flow-model methods on the 2-D ring (docs/methods/lc-grpo.md,
docs/methods/flowcts.md): one method against its baseline from the same pretrained models, with
the same seeds and budget.

    .venv/bin/python benchmarks/flow_claim.py lc-grpo --steps 30
    .venv/bin/python benchmarks/flow_claim.py lc-grpo --steps 30 --model megatron
    .venv/bin/python benchmarks/flow_claim.py flowcts --steps 150
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from types import SimpleNamespace

import torch

from megarl.methods.gradients.flow_run import replicated_model
from megarl.methods.gradients.flowcts import FlowCTSHook, FlowCTSKnobs
from megarl.methods.gradients.lc_grpo import LCGRPOHook, LCGRPOKnobs

GAP_KEYS = ("lc_grpo/reward_sde", "lc_grpo/reward_ode", "lc_grpo/sde_ode_gap")


def _lc_hook(sampler: str, model: str, base) -> LCGRPOHook:
    """An LC-GRPO hook on a copy of the pretrained MLP ``base``, or on the Megatron DiT of the
    example's shape (one process: pretrained afresh from the same seed, so the same weights)."""
    if model == "mlp":
        return LCGRPOHook(LCGRPOKnobs(sampler=sampler), copy.deepcopy(base))
    from megarl.learner.parallel import ParallelLayout, initialize_parallel

    ctx = SimpleNamespace(groups=initialize_parallel(ParallelLayout()))
    return LCGRPOHook(LCGRPOKnobs(sampler=sampler, model="megatron", hidden=32), ctx=ctx)


def lc_grpo(steps: int, model: str = "mlp") -> dict:
    """Flow-GRPO's SDE vs LC transitions: SDE and ODE rewards and their gap (mean of the last 5 steps)."""
    base = replicated_model(LCGRPOKnobs(), 0, LCGRPOKnobs().pretrain_steps) if model == "mlp" else None
    out = {}
    for sampler in ("flow_grpo", "lc"):
        hook = _lc_hook(sampler, model, base)
        recs = [hook.after_step(s, {}) for s in range(1, steps + 1)]
        out[sampler] = {k: round(sum(r[k] for r in recs[-5:]) / len(recs[-5:]), 4) for k in GAP_KEYS}
        out[sampler]["step1"] = {k: round(recs[0][k], 4) for k in GAP_KEYS}
    return out


def flowcts(steps: int) -> dict:
    """KL-OPD vs FlowCTS: the student/reference endpoint error of the ODE samplers along training."""
    k0 = FlowCTSKnobs()
    reference = replicated_model(k0, k0.seed, k0.reference_pretrain_steps)
    student = replicated_model(k0, k0.seed + 1, k0.pretrain_steps)
    out = {}
    for objective in ("kl_opd", "flowcts"):
        knobs = FlowCTSKnobs(objective=objective)
        hook = FlowCTSHook(knobs, copy.deepcopy(student), copy.deepcopy(reference))
        errs = [hook.after_step(s, {})["flowcts/endpoint_error"] for s in range(1, steps + 1)]
        res = {f"err@{i}": round(errs[i - 1], 4) for i in (1, 10, 25, 50, 100, 150) if i <= steps}
        res["mean_err"] = round(sum(errs) / len(errs), 4)
        out[objective] = res
    return out


def main() -> None:
    """Run one claim check and print its figures as JSON."""
    ap = argparse.ArgumentParser()
    ap.add_argument("method", choices=("lc-grpo", "flowcts"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--model", choices=("mlp", "megatron"), default="mlp", help="lc-grpo's flow model")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    if args.method == "flowcts" and args.model != "mlp":
        ap.error("--model megatron: lc-grpo only (the flowcts check runs on the MLP)")
    res = lc_grpo(args.steps, args.model) if args.method == "lc-grpo" else flowcts(args.steps)
    res["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
