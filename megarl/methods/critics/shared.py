"""A value head on the policy's own trunk, trained jointly with it (``inputs.values.model: shared``).

The shared-backbone actor-critic: the policy carries a scalar output head ``value`` on its last
pipeline stage (megarl/learner/heads.py: a replicated ``hidden -> 1`` projection of the final
normed hidden states, zero-initialised, TP/SP-aware), and the objective adds its value loss to the
policy loss, so one backward trains both and the value gradient reaches the trunk:

    L = L_policy + c_v · L_value,     L_value = token-mean over the loss tokens of
        mse ½ (V − R)² | clipped ½ max((V − R)², (V_old + clip(V − V_old, −ε_v, ε_v) − R)²) | huber

V = the head's output in the training forward (aligned like the logprobs: the value of the state
before token t), V_old = ``batch.values`` (the head's values when the batch was scored, which GAE
reads), R = ``batch.returns``. ``c_v`` is the regulariser's ``coef``.

Two parts, one per seam:
- the regulariser ``value_head`` (``objective.regularisers: [{name: value_head, coef: c_v}]``,
  knobs value_loss, value_clip, huber_delta) declares the head (``PartInfo.heads``), so the run
  builds the policy with it; the head's parameters are in the policy's optimizer and checkpoints
  and are left out of its HF export;
- the ``values`` input with ``model: shared`` (``SharedValues``): before the update it fills
  ``batch.values`` from the head (a forward-only pass of the policy) and sets the targets
  (``targets``: the estimator's returns or the Monte Carlo return); nothing trains after the
  step, the policy's optimizer step did.

Provenance: the shared-backbone actor-critic of PPO (Schulman et al. 2017, "Proximal Policy
Optimization Algorithms", arXiv 1707.06347, the loss L^{CLIP+VF} with coefficient c_1); the
clipped value loss follows PPO's reference implementations.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.objectives.api import LossContext
from megarl.objectives.regularisers import REGULARISERS
from megarl.objectives.value_losses import VALUE_LOSS_KINDS, ValueObjective

HEAD = "value"


@REGULARISERS.register(
    "value_head", batch_inputs=("values",), aggregates_itself=True, heads=(HEAD,), reads_logits=False
)
def value_head_loss(
    logits: torch.Tensor,
    logp: torch.Tensor,
    old: torch.Tensor,
    batch: PackedBatch,
    ctx: LossContext,
    value_loss: str = "clipped",
    value_clip: float = 0.2,
    huber_delta: float = 1.0,
) -> torch.Tensor:
    """This micro-batch's share of the global token-mean value loss of the policy's ``value`` head
    (``ctx.heads["value"]`` [T]) toward ``batch.returns``, clipped around ``batch.values``."""
    if value_loss not in VALUE_LOSS_KINDS:
        raise ValueError(
            f"objective.regularisers: value_head value_loss={value_loss!r}; "
            f"known: {', '.join(VALUE_LOSS_KINDS)}"
        )
    v = ctx.heads.get(HEAD)
    if v is None:
        raise ValueError(
            "objective.regularisers: value_head reads the policy's 'value' output head, which this "
            "learner does not carry (build it with heads=('value',))"
        )
    if batch.returns is None or batch.values is None:
        raise ValueError(
            "objective.regularisers: value_head needs the batch fields 'values' (V_old) and 'returns' "
            "(inputs.values with model: shared fills them)"
        )
    return ValueObjective(value_loss, value_clip, huber_delta)(v[:, None], batch, ctx).loss


# knobs of the values input that belong to another model kind, with their defaults
_NOT_SHARED = {"lr": 1.0e-3, "value_loss": "clipped", "value_clip": 0.2, "huber_delta": 1.0, "epochs": 1}


def check_shared_knobs(knobs: Any) -> None:
    """Refuse ``inputs.values`` knobs that ``model: shared`` does not use, naming each."""
    for k, default in _NOT_SHARED.items():
        if getattr(knobs, k) != default:
            raise ValueError(
                f"inputs.values.{k}={getattr(knobs, k)!r} does not apply to model: shared (the head "
                "trains in the policy's optimizer step; its loss knobs are the value_head regulariser's: "
                "objective.regularisers: [{name: value_head, coef: ..., value_loss: ..., value_clip: ...}])"
            )
    for k in ("context", "warmup_steps", "bounds", "boundaries", "sarsa_coef", "router"):
        if getattr(knobs, k):
            raise ValueError(f"inputs.values.{k}={getattr(knobs, k)!r} is not supported with model: shared")


class SharedValues:
    """The ``values`` input read from the policy's own ``value`` head; see the module docstring."""

    def __init__(self, ctx: Any, knobs: Any):
        from megarl.methods.critics.critic import value_targets

        check_shared_knobs(knobs)
        self.policy, self.knobs = ctx.policy, knobs
        # (a context without the policy builds the part for its checkpoint state only)
        if self.policy is not None and HEAD not in getattr(self.policy.cfg, "heads", ()):
            raise ValueError(
                "inputs.values.model: shared reads the policy's value head, which no objective part "
                "declares: add {name: value_head, coef: 0.5} to objective.regularisers"
            )
        self._targets = value_targets
        self.gamma = float(ctx.cfg.advantage.knobs.get("gamma", 1.0))
        self._batch: PackedBatch | None = None
        self.needs_inputs: tuple[str, ...] = ()

    def fill(self, batch: PackedBatch, micro_batches: int) -> dict[str, float]:
        """``batch.values`` [T] from the policy's value head (collective)."""
        batch.values = self.policy.compute_head(batch, HEAD, micro_batches)
        m = batch.loss_mask.bool()
        return {"critic/values_old": float(batch.values[m].mean()) if bool(m.any()) else 0.0}

    def before_train(self, step: int, batch: PackedBatch) -> PackedBatch:
        """The head's targets (``batch.returns``); advantages whitened if asked."""
        from megarl.advantages.estimators import whiten

        batch.returns = self._targets(batch, self.knobs.targets, self.gamma, self.knobs.lam)
        if batch.returns is None:
            raise ValueError(
                "inputs.values: the value head trains toward batch.returns, which this run's advantage "
                "estimator does not write (use advantage.estimator: gae, or inputs.values.targets: "
                "monte_carlo)"
            )
        if self.knobs.whiten_advantages:
            batch.advantages = whiten(batch.advantages, batch.loss_mask)
        self._batch = batch
        return batch

    def after_step(self, step: int, metrics: dict) -> dict[str, float]:
        """The explained variance of the targets by V_old (the head trained in the policy's step)."""
        batch, self._batch = self._batch, None
        if batch is None or batch.returns is None or batch.values is None:
            return {}
        m = batch.loss_mask.bool()
        ret, old = batch.returns[m].double(), batch.values[m].double()
        var = float(ret.var()) if ret.numel() > 1 else 0.0
        return {"critic/explained_variance": 1.0 - float((ret - old).var()) / var if var > 0 else 0.0}

    def state_dict(self) -> dict:
        """Nothing: the head's weights and Adam state are in the policy's checkpoint."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore (see ``state_dict``)."""
