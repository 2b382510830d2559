"""A method from outside megarl, as a user writes one: bounded advantages.

GRPO advantages, then every token's advantage clipped to [-bound, bound] before the optimizer
steps, so that one outlier group cannot dominate an update. The method contributes through the
seam only: its ``MethodSpec`` sets the advantage estimator (GRPO, a built-in part), declares its
knobs, and builds a step hook that clips and keeps a running count in its checkpoint state.

Run it with the plugin's folder on the import path::

    PYTHONPATH=examples/plugins megarl train examples/quickstart.yaml \
        method.import=bounded_advantages:SPEC method.bound=1.0

Provenance: an example written for megarl's documentation (no paper).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.batch import PackedBatch
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodParts, MethodSpec


def bounded(adv: torch.Tensor, bound: float) -> torch.Tensor:
    """The reference formula: clip(A_t, -bound, bound) per token; adv: [T] -> [T]."""
    return adv.clamp(-bound, bound)


@dataclass
class BoundedKnobs(Knobs):
    """``bound``: the largest |advantage| a token keeps."""

    bound: float = 2.0

    def check(self) -> None:
        """The bound must be positive."""
        if self.bound <= 0:
            raise ValueError(f"bound={self.bound} must be > 0")


class BoundAdvantages:
    """A step hook: clips ``batch.advantages`` and counts the clipped loss tokens (checkpointed)."""

    def __init__(self, bound: float):
        self.bound = bound
        self.clipped_total = 0

    def before_train(self, step: int, batch: PackedBatch) -> PackedBatch:
        """Clip the advantages in place; remember how many loss tokens changed."""
        m = batch.loss_mask.bool()
        self._clipped = int((batch.advantages[m].abs() > self.bound).sum())
        self._tokens = int(m.sum())
        self.clipped_total += self._clipped
        batch.advantages = bounded(batch.advantages, self.bound)
        return batch

    def after_step(self, step: int, metrics: dict) -> dict[str, float]:
        """This step's clipped fraction and the running total."""
        return {
            "bounded/clipped_frac": self._clipped / max(self._tokens, 1),
            "bounded/clipped_total": float(self.clipped_total),
        }

    def state_dict(self) -> dict:
        """The running count."""
        return {"clipped_total": self.clipped_total}

    def load_state_dict(self, state: dict) -> None:
        """Restore the running count."""
        self.clipped_total = int(state["clipped_total"])


def build(ctx, knobs: BoundedKnobs) -> MethodParts:
    """The method's parts for one run: the clipping hook."""
    return MethodParts(step_hooks=[BoundAdvantages(knobs.bound)])


SPEC = MethodSpec(
    name="bounded_advantages",
    summary="GRPO advantages clipped to [-bound, bound] per token",
    provenance="reconstructed",
    config={"advantage": {"estimator": "grpo"}},
    knobs=BoundedKnobs,
    build=build,
)
