"""Advantage estimators on the packed batch (formulas and provenance: reference/advantages.py).

Every estimator in ADVANTAGE_ESTIMATORS has the signature ``fn(batch, **knobs) -> [T]`` per-token
advantages (0 off the loss mask). Run them on the whole batch of complete groups, before it is
split into micro-batches or data-parallel shards.
"""

from megarl.advantages.estimators import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    dr_grpo,
    gae,
    grpo,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "compute_advantages",
    "dr_grpo",
    "gae",
    "grpo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "rloo",
]
