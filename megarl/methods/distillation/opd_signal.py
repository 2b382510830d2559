"""The sampled-token on-policy-distillation signal shared by the teacher-shaped advantages
(Distilled RL, OPD regulation, RA-OPD, OPDVR/GRPD): the token reward
ℓ_t = log π_T(y_t) − log π_old(y_t) on the loss tokens, the outcome verdict per sequence, and
the per-batch diagnostics those estimators report.

The teacher's logprobs come from the ``teacher_logprobs`` input (a forward-only teacher learner,
``teacher.hf_dir``); π_old is the behaviour policy (``old_logprobs``, else the rollout engine's).
"""

from __future__ import annotations

import torch

from megarl.advantages.estimators import scalar_rewards
from megarl.batch import PackedBatch


def behaviour_logprobs(batch: PackedBatch, who: str) -> torch.Tensor:
    """log π_old [T] (float64, detached): ``old_logprobs``, else ``rollout_logprobs``; errors name
    ``who``."""
    old = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
    if old is None:
        raise ValueError(f"{who} needs the batch field 'old_logprobs' (or 'rollout_logprobs')")
    return old.detach().double()


def opd_reward(batch: PackedBatch, who: str) -> torch.Tensor:
    """ℓ_t = log π_T(y_t) − log π_old(y_t) on loss tokens, 0 elsewhere; [T] float64, detached (a
    constant of the loss)."""
    if batch.teacher_logprobs is None:
        raise ValueError(f"{who} needs the batch field 'teacher_logprobs' (set teacher.hf_dir)")
    m = batch.loss_mask.double()
    return (batch.teacher_logprobs.detach().double() - behaviour_logprobs(batch, who)) * m


def correct(batch: PackedBatch, threshold: float) -> torch.Tensor:
    """The verifier's verdict per sequence: outcome reward > ``threshold``; [B] bool."""
    return scalar_rewards(batch) > threshold


class Diagnostics:
    """The last batch's metrics of an estimator (reported each step; nothing to checkpoint)."""

    def __init__(self, **_knobs):
        self.last: dict[str, float] = {}

    def metrics(self) -> dict[str, float]:
        """The metrics of the last batch the estimator saw."""
        return dict(self.last)

    def state_dict(self) -> dict:
        """Empty: the diagnostics are recomputed every step."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore."""


def token_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of ``x`` over the masked-in tokens (0 when there are none)."""
    m = mask.bool()
    return float(x[m].double().mean()) if bool(m.any()) else 0.0
