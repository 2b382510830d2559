"""EPPO: task-wise clip bounds paced by each task's running entropy (formula and provenance:
reference/trust_regions.py:eppo_update, eppo_task_scales, eppo). Registered as the policy loss ``eppo``.

State (per-task EMA entropy, first entropy, seen flags) lives in the RLObjective
(``make_state``), is saved with ``objective.state_dict()`` and restored with
``load_state_dict()``. ``prepare`` (once per step, whole batch) reads the batch's per-token
entropy ``batch.entropies`` (full-vocab, from the learner's old-logprob pass:
``compute_logprobs(..., with_entropy=True)``), all-reduces 2 floats per task over DP, updates the
state and stores each sequence's clip multiplier in ``batch.extras['eppo_scale']``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.objectives.policy_losses import POLICY_LOSSES
from megarl.ops import comm
from megarl.ops.segments import broadcast_to_tokens, segment_sum
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo

SCALE = "eppo_scale"


class EppoState:
    """Per-task entropy statistics: ema [K], initial [K] (float64), seen [K] bool, updates (steps)."""

    def __init__(self, num_tasks: int):
        if isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1:
            raise ValueError(f"eppo: policy_loss_args.num_tasks={num_tasks!r} must be a positive integer")
        self.ema = torch.zeros(num_tasks, dtype=torch.float64)
        self.initial = torch.zeros(num_tasks, dtype=torch.float64)
        self.seen = torch.zeros(num_tasks, dtype=torch.bool)
        self.updates = 0

    def update(self, sums: torch.Tensor, counts: torch.Tensor, momentum: float) -> None:
        """EMA step from the global batch's per-task entropy sums and token counts [K]."""
        has = counts > 0
        mu = sums / counts.clamp(min=1)
        first = has & ~self.seen
        again = has & self.seen
        self.ema = torch.where(again, momentum * self.ema + (1 - momentum) * mu, self.ema)
        self.ema = torch.where(first, mu, self.ema)
        self.initial = torch.where(first, mu, self.initial)
        self.seen = self.seen | has
        self.updates += 1

    def scales(self, kappa: float, c_min: float, c_max: float, h_ref: str) -> torch.Tensor:
        """Clip multiplier per task [K] (1 for unseen tasks or H_ref <= 0)."""
        if h_ref == "initial":
            ref = self.initial
        else:
            ref = torch.full_like(self.ema, float(self.ema[self.seen].mean()) if self.seen.any() else 0.0)
        ok = self.seen & (ref > 0)
        ratio = torch.where(ok, self.ema / torch.where(ok, ref, torch.ones_like(ref)), torch.ones_like(ref))
        return torch.where(ok, torch.clamp(ratio**kappa, c_min, c_max), torch.ones_like(ref))

    def state_dict(self) -> dict[str, Any]:
        return {
            "ema": self.ema.clone(),
            "initial": self.initial.clone(),
            "seen": self.seen.clone(),
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in ("ema", "initial", "seen"):
            if tuple(state[k].shape) != tuple(self.ema.shape):
                raise ValueError(
                    f"eppo state '{k}' has shape {tuple(state[k].shape)}, this objective has "
                    f"num_tasks={self.ema.numel()}"
                )
        self.ema, self.initial = state["ema"].double().clone(), state["initial"].double().clone()
        self.seen, self.updates = state["seen"].bool().clone(), int(state["updates"])


def _check(momentum, kappa, c_min, c_max, h_ref):
    if not 0 <= momentum < 1:
        raise ValueError(f"eppo: policy_loss_args.momentum={momentum!r} must be in [0, 1)")
    if not 0 < c_min <= 1 <= c_max:
        raise ValueError(
            f"eppo: policy_loss_args c_min={c_min!r}, c_max={c_max!r} need 0 < c_min <= 1 <= c_max"
        )
    if h_ref not in ("mean", "initial"):
        raise ValueError(f"eppo: policy_loss_args.h_ref={h_ref!r}; allowed: mean, initial")
    if not kappa >= 0:
        raise ValueError(f"eppo: policy_loss_args.kappa={kappa!r} must be >= 0")


def make_state(*, num_tasks: int = 16, **_) -> EppoState:
    """Fresh per-task statistics for ``num_tasks`` tasks (task ids 0..num_tasks-1)."""
    return EppoState(num_tasks)


def prepare(
    batch: PackedBatch,
    dp_group: Any,
    state: EppoState,
    *,
    num_tasks: int = 16,
    momentum: float = 0.9,
    kappa: float = 1.0,
    c_min: float = 0.5,
    c_max: float = 2.0,
    h_ref: str = "mean",
    **_,
) -> PackedBatch:
    """Update the per-task entropy EMA with this step's global batch; extras['eppo_scale'] [B]."""
    _check(momentum, kappa, c_min, c_max, h_ref)
    unknown = sorted(set(_) - {"adapt_low"})
    if unknown:
        raise ValueError(
            f"eppo: unknown policy_loss_args {unknown}; allowed: num_tasks, momentum, kappa, c_min, "
            "c_max, h_ref, adapt_low"
        )
    if batch.entropies is None:
        raise ValueError(
            "eppo needs the batch field 'entropies' ([T] full-vocab entropy of the old policy: "
            "learner.compute_logprobs(batch, with_entropy=True))"
        )
    K = state.ema.numel()
    tid = (
        batch.task_ids if batch.task_ids is not None else torch.full((batch.num_seqs,), -1, dtype=torch.long)
    )
    if tid.numel() and int(tid.max()) >= K:
        seq = int((tid >= K).nonzero()[0])
        raise ValueError(f"eppo: task_ids[{seq}]={int(tid[seq])} is >= policy_loss_args.num_tasks={K}")
    dt = torch.float64
    m = batch.loss_mask.to(dt)
    h_sum = segment_sum(m * batch.entropies.to(dt), batch.cu_seqlens)
    n = segment_sum(m, batch.cu_seqlens)
    has = tid >= 0
    stats = torch.zeros(2 * K, dtype=dt)
    stats[:K].index_add_(0, tid[has], h_sum[has])
    stats[K:].index_add_(0, tid[has], n[has])
    comm.all_reduce(stats, "sum", dp_group)
    state.update(stats[:K], stats[K:], momentum)
    c = state.scales(kappa, c_min, c_max, h_ref)
    scale = torch.where(has, c[tid.clamp(min=0)], torch.ones(batch.num_seqs, dtype=dt))
    return dataclasses.replace(batch, extras={**batch.extras, SCALE: scale})


def _token_scale(batch: PackedBatch, cu_seqlens, dtype):
    if SCALE not in batch.extras:
        raise ValueError(
            "eppo: batch.extras has no 'eppo_scale': call objective.prepare(batch, dp_group) on the "
            "whole batch before splitting it into micro-batches"
        )
    return broadcast_to_tokens(batch.extras[SCALE].to(dtype), cu_seqlens)


def eppo(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=0.2,
    clip_high=0.28,
    dual_clip=None,
    *,
    batch: PackedBatch,
    ctx=None,
    adapt_low: bool = True,
    **_,
) -> torch.Tensor:
    """PPO clip with bounds (1 − ε_l·c_k, 1 + ε_h·c_k) of the sample's task k; [T] -> [T]."""
    c = _token_scale(batch, cu_seqlens, logp.dtype)
    lo = clip_low * c if adapt_low else torch.full_like(c, clip_low)
    r = torch.exp(logp - old_logp)
    loss = torch.maximum(-r * adv, -torch.clamp(r, 1 - lo, 1 + clip_high * c) * adv)
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    return loss


def _token_metrics(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=0.2,
    clip_high=0.28,
    dual_clip=None,
    *,
    batch: PackedBatch,
    ctx=None,
    **_,
) -> dict[str, torch.Tensor]:
    """Mean task clip multiplier per token."""
    return {"clip_scale": _token_scale(batch, cu_seqlens, logp.dtype)}


POLICY_LOSSES.add(
    "eppo",
    eppo,
    PartInfo(
        batch_inputs=("entropies",),
        needs_context=True,
        make_state=make_state,
        prepare=prepare,
        token_metrics=_token_metrics,
    ),
)

SPEC = MethodSpec(
    name="eppo",
    summary="EPPO: task-wise clip ranges from running task entropies",
    provenance="reconstructed",
    config={"objective": {"policy_loss": "eppo"}},
)
