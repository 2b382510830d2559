"""RSPO: reward swap between outcome and dense process rewards (formula: reference/reward_shaping.py).

Registered as the advantage estimator ``rspo``. The batch carries both rewards as named dimensions
(``rewards [B, K]``, ``reward_names``); without a process dimension the process reward of a sequence
is the sum of its ``token_rewards`` over loss tokens (a PRM's per-step scores).
"""

from __future__ import annotations

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, dr_grpo, grpo, per_token, rloo
from megarl.ops.segments import group_all_equal, segment_sum
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo

BASES = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo}


def rspo(
    outcome: torch.Tensor,
    process: torch.Tensor,
    group_ids: torch.Tensor,
    base: str = "grpo",
    reading: str = "A",
) -> torch.Tensor:
    """Reading A: base(outcome) where the group's outcomes differ, base(process) elsewhere;
    reading B: base(outcome) everywhere. [B] -> [B]."""
    if base not in BASES:
        raise ValueError(f"rspo: base={base!r}; allowed: {', '.join(BASES)}")
    if reading not in ("A", "B"):
        raise ValueError(f"rspo: reading={reading!r}; allowed: A, B")
    a_out = BASES[base](outcome, group_ids)
    if reading == "B":
        return a_out
    return torch.where(group_all_equal(outcome, group_ids), BASES[base](process, group_ids), a_out)


def rspo_keep(process: torch.Tensor, group_ids: torch.Tensor, keep: int) -> torch.Tensor:
    """Reading B's exploration step: per group, the ``keep`` trajectories spread evenly over the
    process-reward ranking (all of a group with <= keep). Returns kept indices, ascending."""
    if keep < 1:
        raise ValueError(f"rspo_keep: keep={keep} must be >= 1")
    order = torch.argsort(process.double() + 0.0, stable=True)
    order = order[torch.argsort(group_ids[order], stable=True)]  # grouped, by process reward within a group
    gids_sorted = group_ids[order]
    _uniq, counts = torch.unique_consecutive(gids_sorted, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    kept = []
    for s, n in zip(starts.tolist(), counts.tolist()):
        if n <= keep:
            ranks = list(range(n))
        elif keep == 1:
            ranks = [n - 1]
        else:
            ranks = sorted({round(j * (n - 1) / (keep - 1)) for j in range(keep)})
        kept.append(order[s + torch.tensor(ranks, dtype=torch.long)])
    return torch.sort(torch.cat(kept)).values


def outcome_and_process(batch, outcome: str, process: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The outcome and process rewards [B] of a batch (see the module docstring)."""
    r, names = batch.rewards, batch.reward_names
    if r is None or r.dim() != 2 or not names:
        raise ValueError("advantage_estimator=rspo needs 'rewards' [B, K] with 'reward_names'")
    if outcome not in names:
        raise ValueError(f"rspo: outcome reward {outcome!r} not in reward_names {names}")
    out = r[:, names.index(outcome)].double()
    if process in names:
        return out, r[:, names.index(process)].double()
    if batch.token_rewards is None:
        raise ValueError(
            f"rspo: process reward {process!r} not in reward_names {names} and no 'token_rewards'"
        )
    return out, segment_sum(batch.token_rewards.double() * batch.loss_mask.double(), batch.cu_seqlens)


def _rspo(
    batch, base: str = "grpo", reading: str = "A", outcome: str = "outcome", process: str = "process"
) -> torch.Tensor:
    """RSPO on every loss token; [T]."""
    out, proc = outcome_and_process(batch, outcome, process)
    return per_token(batch, rspo(out, proc, batch.group_ids, base, reading))


ADVANTAGE_ESTIMATORS.add("rspo", _rspo, PartInfo(batch_inputs=("reward_dims",), group_relative=True))

SPEC = MethodSpec(
    name="rspo",
    summary="RSPO: reward swap between outcome and process rewards",
    provenance="reconstructed",
    config={"advantage": {"estimator": "rspo"}},
)
