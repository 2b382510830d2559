"""Skip the optimizer step when the gradients are not finite.

megatron-core's optimizers only check for inf/NaN when they own a gradient scaler (fp16). In fp32
and in bf16 without a loss scale (megarl's learner on CPU and GPU), ``optimizer.step()`` clips by a
NaN norm (``max_norm / nan < 1`` is False, so nothing is clipped) and Adam writes NaN into every
weight. ``NonFiniteGuard`` wraps the learner's ``optimizer.step``: it prepares the gradients,
computes their global norm (the same collective the optimizer runs, so every rank decides alike)
and, when it is not finite, returns ``(False, norm, None)`` without touching the weights or the
optimizer state. The learner then reports ``update_successful = 0`` and does not advance the LR
schedule.
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
        self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm())
        self.last_norm = norm
        if not math.isfinite(norm):
            self.skipped += 1
            return False, norm, None
        return self._inner_step()
