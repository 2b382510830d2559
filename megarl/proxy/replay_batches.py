"""The batches a replay trains on: this rank's data-parallel share, old logprobs of the replay
model, and the step's batch poison put back the way the run applied it.

A run poisons the batch after the learner computed its old logprobs, so the dump's batch holds
poisoned tokens next to old logprobs of the clean ones. Recomputing old logprobs on that batch
(what a proxy needs, its policy is not the original's) would make the PPO ratio 1 on the poisoned
tokens and erase the fault. Dumps therefore keep the batch before the poison (``clean_batch``):
the replay recomputes on it and poisons it again with the recorded injection (deterministic in
its seed), which gives the dumped batch's tokens and advantages back bit for bit. A dump without
the clean batch keeps the dumped old logprobs for a token poison and says so.
"""

from __future__ import annotations

import torch

from megarl.batch import PackedBatch
from megarl.faults.dump import concat_batches


def _share(shares: list[PackedBatch], whole: PackedBatch | None, dp_rank: int, dp_size: int):
    """This DP rank's share, the shares joined on one replica, or the single-rank batch."""
    if not shares:
        return whole
    return shares[dp_rank] if dp_size == len(shares) else concat_batches(shares)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _recompute(learner, mb: PackedBatch, num_micro_batches: int) -> None:
    """Old logprobs of ``mb`` by the replay model (forward only); the rollout logprobs keep the
    run's per-token engine-vs-learner difference."""
    if mb.old_logprobs is None:
        return
    new_old, _ = learner.compute_logprobs(mb, num_micro_batches)
    if mb.rollout_logprobs is not None:
        mb.rollout_logprobs = new_old + (mb.rollout_logprobs - mb.old_logprobs)
    mb.old_logprobs = new_old


def prepare_batches(
    batches: list[dict],
    learner,
    injector,
    step: int,
    groups,
    recorded: list,
    old_logprobs: str,
    proxy: bool,
) -> dict:
    """Set ``b['batch']`` of every dumped optimizer step to what the replay trains on.

    ``recorded``: the dump's injections (InjectionConfig); ``injector``: an Injector holding them,
    or None for ``--no-inject``; ``old_logprobs``: 'auto' (recompute when ``proxy``), 'dump' or
    'recompute'. Returns ``notes``, ``poison`` (the poison was re-applied on the clean batch) and
    ``in_batch`` (the poison is in the dumped batch and used as it is).
    """
    poisons = [s for s in recorded if s.kind == "poison" and s.step == step]
    tokens_poisoned = any(s.field == "tokens" for s in poisons)
    inject = injector is not None
    notes: list[str] = []
    reapplied = in_batch = False
    recompute = old_logprobs == "recompute" or (old_logprobs == "auto" and proxy)
    recomputed = kept_for_tokens = False
    for b in batches:
        dumped = _share(b["dp_shares"], b["batch"], groups.dp_rank, groups.dp_size)
        clean = _share(b.get("clean_dp_shares") or [], b.get("clean_batch"), groups.dp_rank, groups.dp_size)
        if clean is None:
            base = dumped
            in_batch = in_batch or bool(poisons)
        else:
            base = clean
        token_poisoned_base = clean is None and tokens_poisoned
        if recompute and not (token_poisoned_base and old_logprobs == "auto"):
            _recompute(learner, base, b["num_micro_batches"])
            recomputed = True
        elif recompute:
            kept_for_tokens = True
        if clean is not None and inject and poisons:
            again, applied = injector.poison(base, step)
            if applied:
                reapplied = True
                if not (_same(again.tokens, dumped.tokens) and _same(again.advantages, dumped.advantages)):
                    notes.append(
                        "the re-applied poison differs from the dumped batch (tokens or advantages); "
                        "the replay trains on the re-applied one"
                    )
                base = again
        b["batch"] = base
    if recomputed:
        notes.append(
            "old logprobs recomputed with this model (on-policy, as the run was); rollout logprobs "
            "moved with them (the run's engine-vs-learner difference kept per token)"
        )
    if reapplied:
        notes.append(
            "poison re-applied on the dump's clean batch (the batch before the poison), after its "
            "old logprobs, as the run did"
        )
    if kept_for_tokens:
        notes.append(
            "old logprobs kept from the dump for the token-poisoned batch: the dump holds no clean "
            "batch, and recomputing them on the poisoned tokens would erase the fault"
        )
    if poisons and not inject and not in_batch:
        notes.append("trained on the dump's clean batch (before the poison): the poison is left out")
    if in_batch and not inject:
        notes.append("the poison cannot be removed: the dump holds only the poisoned batch (no clean batch)")
    if in_batch and tokens_poisoned and recompute and not kept_for_tokens:
        notes.append(
            "old logprobs recomputed on poisoned tokens (--old-logprobs recompute): the token "
            "poison's signal is erased"
        )
    return {"notes": notes, "poison": reapplied, "in_batch": in_batch}
