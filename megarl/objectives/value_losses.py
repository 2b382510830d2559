"""Value (critic) losses on packed tokens, globally normalised like the policy losses.

A ``ValueObjective`` is called by a value learner's ``train_step`` exactly as a policy objective is
called by the policy's: ``objective(out, batch, ctx)`` with ``out: [T, 1]`` the aligned values of
this micro-batch. ``batch.values`` holds the values GAE used (V_old) and ``batch.returns`` the
targets. Reference: ``reference/critics.py``.
"""

from __future__ import annotations

import torch

from megarl.batch import PackedBatch
from megarl.objectives.api import LossContext, LossOutput

ValueLossKind = str  # "mse" | "clipped" | "huber" (VALUE_LOSS_KINDS)
VALUE_LOSS_KINDS: tuple[str, ...] = ("mse", "clipped", "huber")


def value_loss_per_token(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    kind: ValueLossKind = "clipped",
    clip: float = 0.2,
    huber_delta: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [T], clipped [T] bool: the clipped branch is the larger) for values, V_old, R: [T]."""
    err = values - returns
    if kind == "mse":
        return 0.5 * err.square(), torch.zeros_like(err, dtype=torch.bool)
    if kind == "huber":
        a = err.abs()
        loss = torch.where(a <= huber_delta, 0.5 * err.square(), huber_delta * (a - 0.5 * huber_delta))
        return loss, torch.zeros_like(err, dtype=torch.bool)
    if kind != "clipped":
        raise ValueError(f"unknown value loss {kind!r}; known: {', '.join(VALUE_LOSS_KINDS)}")
    moved = old_values + torch.clamp(values - old_values, -clip, clip)
    unclipped, clipped = err.square(), (moved - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


class ValueObjective:
    """Token-mean value loss over the global batch (``ctx.normalisers.num_tokens``, at least 1)."""

    def __init__(self, kind: ValueLossKind = "clipped", clip: float = 0.2, huber_delta: float = 1.0):
        if kind not in VALUE_LOSS_KINDS:
            raise ValueError(f"unknown value loss {kind!r}; known: {', '.join(VALUE_LOSS_KINDS)}")
        self.kind, self.clip, self.huber_delta = kind, clip, huber_delta

    def __call__(self, out: torch.Tensor, batch: PackedBatch, ctx: LossContext) -> LossOutput:
        """out: [T, 1] values of this micro-batch -> its contribution to the global loss."""
        if batch.values is None or batch.returns is None:
            raise ValueError("a value loss needs the batch fields 'values' (V_old) and 'returns'")
        v = out[:, 0].to(torch.promote_types(out.dtype, torch.float32))  # bf16 -> fp32, fp64 stays
        m = batch.loss_mask.to(v)
        per_token, clipped = value_loss_per_token(
            v, batch.values.to(v), batch.returns.to(v), self.kind, self.clip, self.huber_delta
        )
        n = max(ctx.normalisers.num_tokens, 1.0)  # a batch without loss tokens: 0, not 0/0
        d = v.detach()
        return LossOutput(
            loss=(per_token * m).sum() / n,
            metrics={
                "value_loss": (per_token.detach() * m).sum() / n,
                "value_clipfrac": (clipped.to(v) * m).sum() / n,
                "value_mean": (d * m).sum() / n,
                "value_abs_error": ((d - batch.returns.to(v)).abs() * m).sum() / n,
            },
        )
