"""Shared test plumbing of method family 1 (trust regions): run megarl's composed objective with
its ``prepare`` step on every data-parallel shard, and a padded reference written by the test.

megarl side: each DP rank gets its own objective (so stateful parts keep per-rank state) and runs
``objective.prepare(shard, dp_group)`` with the DP ranks as simulated threads; the prepared
per-sequence extras are merged back and the foundation harness (megarl.testing.equivalence) runs
the TP-sharded, micro-batched objective. Reference side: the test's function of the full padded
logits [B, L, V] and the padded batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from megarl.batch import PaddedBatch, unpack
from megarl.objectives.rl_objective import RLObjective, build_objective
from megarl.testing.equivalence import Case, megarl_loss_and_grad, split_sequences
from megarl.testing.simulated_group import SimulatedWorld
from reference import aggregation as ref_agg
from reference.logprobs import token_logprobs


def prepare_on_dp_ranks(
    case: Case, dp: int, objectives: list[RLObjective] | None = None
) -> tuple[Case, list[RLObjective]]:
    """Run ``prepare`` of one objective per DP shard (threads, simulated DP group); return the
    case with the merged prepared batch and the objectives."""
    b = case.batch
    shards = split_sequences(b.num_seqs, dp)
    objectives = objectives or [build_objective(case.cfg) for _ in shards]
    prepared = SimulatedWorld(len(shards)).run(lambda r, g: objectives[r].prepare(b.select(shards[r]), g))
    keys = set().union(*(p.extras for p in prepared))
    extras = dict(b.extras)
    for k in keys:
        extras[k] = torch.cat([p.extras[k] for p in prepared])
    return dataclasses.replace(case, batch=dataclasses.replace(b, extras=extras)), objectives


def megarl_method_loss_and_grad(
    case: Case, tp: int, dp: int = 1, micro_batches: int = 1, objectives: list[RLObjective] | None = None
):
    """prepare on each DP shard, then the TP-sharded, micro-batched objective; (loss, grad [T, V])."""
    prepared, objs = prepare_on_dp_ranks(case, dp, objectives)
    return megarl_loss_and_grad(prepared, tp=tp, dp=dp, micro_batches=micro_batches, objective=objs[0])


def reference_method_loss_and_grad(case: Case, ref_fn: Callable[[torch.Tensor, PaddedBatch], torch.Tensor]):
    """``ref_fn(full_logits [B, L, V], padded_batch) -> scalar`` and d/d logits as packed [T, V]."""
    pad = unpack(case.batch)
    am = pad.attention_mask
    full = torch.zeros(am.shape + (case.logits.shape[-1],), dtype=case.logits.dtype)
    full[am] = case.logits
    full.requires_grad_(True)
    loss = ref_fn(full, pad)
    loss.backward()
    return loss.detach(), full.grad[am]


def padded_inputs(full: torch.Tensor, pad: PaddedBatch):
    """(logp, old_logp, adv, mask) of the padded batch, old = old_logprobs or rollout_logprobs."""
    tok = pad.per_token
    old = tok.get("old_logprobs", tok.get("rollout_logprobs"))
    return token_logprobs(full, pad.tokens), old, tok["advantages"], pad.loss_mask


def aggregate(x: torch.Tensor, pad: PaddedBatch, mode: str) -> torch.Tensor:
    """Reference aggregation of per-token losses [B, L] with the batch's own L_max."""
    return ref_agg.aggregate(x, pad.loss_mask, mode)


def assert_equivalent(got, want, logits: torch.Tensor, rtol: float = 1e-9, atol: float = 1e-10) -> None:
    """Loss and gradient agree; atol scaled like tests/property/test_objective_equivalence.py."""
    (loss, grad), (ref_loss, ref_grad) = got, want
    zmax = max(1.0, float(logits.abs().max()))
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol * max(zmax, float(ref_loss.abs())))
    gscale = max(zmax, float(ref_grad.abs().max()) if ref_grad.numel() else 1.0)
    torch.testing.assert_close(grad, ref_grad, rtol=rtol, atol=atol * gscale)
