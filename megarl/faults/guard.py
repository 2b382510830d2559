"""Skip the optimizer step when the gradients are not finite.

megatron-core's optimizers only check for inf/NaN when they own a gradient scaler (fp16). In fp32
and in bf16 without a loss scale (megarl's learner on CPU and GPU), ``optimizer.step()`` clips by a
NaN norm (``max_norm / nan < 1`` is False, so nothing is clipped) and Adam writes NaN into every
weight. ``NonFiniteGuard`` wraps the learner's ``optimizer.step``: it prepares the gradients,
computes their global norm (the same collective the optimizer runs, so every rank decides alike)
and, when it is not finite, returns ``(False, norm, None)`` without touching the weights or the
optimizer state. The learner then reports ``update_successful = 0`` and does not advance the LR
schedule. When it is finite, the guard finishes the step itself with that norm (clip by it, then
the optimizer's ``step_with_ready_grads``), as megatron-core's ``ChainedOptimizer.step`` does, so
the global norm and its collective run once per step, not twice; an optimizer without those
methods, or one that counts zero gradients, gets its own ``step`` after the check instead.
"""

from __future__ import annotations

import math


class NonFiniteGuard:
    """Installed on one learner; ``skipped`` counts the optimizer steps it refused."""

    def __init__(self, learner):
        self.learner = learner
        self.optimizer = learner.optimizer
        self._inner_step = self.optimizer.step
        self.skipped = 0
        self.last_norm: float | None = None

    def install(self) -> NonFiniteGuard:
        """Wrap ``learner.optimizer.step`` (an attribute of this optimizer instance only)."""
        self.optimizer.step = self.step
        return self

    def uninstall(self) -> None:
        """Put the optimizer's own ``step`` back."""
        if self.optimizer.__dict__.get("step") == self.step:
            del self.optimizer.step

    def step(self):
        """The optimizer step, or a skip when the global gradient norm is inf/NaN."""
        opt = self.optimizer
        if opt.prepare_grads():  # a loss scaler found inf/NaN: megatron's own skip
            return False, None, None
        total = opt.get_grad_norm()
        norm = float(total)
        self.last_norm = norm
        if not math.isfinite(norm):
            self.skipped += 1
            return False, norm, None
        if not _finishes_with_norm(opt):
            return self._inner_step()
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        for part in getattr(opt, "chained_optimizers", [opt]):
            if getattr(part, "is_stub_optimizer", False) or part.config.clip_grad <= 0.0:
                continue
            params = part.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(
                    params,
                    max_norm=part.config.clip_grad,
                    total_norm=total,
                    use_decoupled_grad=part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                )
        return opt.step_with_ready_grads(), total, None


def _finishes_with_norm(opt) -> bool:
    """Whether the guard can finish ``opt``'s step from the norm it computed: the optimizer (and
    each chained one) has ``step_with_ready_grads`` and a config without zero counting."""
    parts = getattr(opt, "chained_optimizers", [opt])
    return callable(getattr(opt, "step_with_ready_grads", None)) and all(
        callable(getattr(p, "get_parameters", None))
        and hasattr(p.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8")
        and not p.config.log_num_zeros_in_grad
        for p in parts
    )
