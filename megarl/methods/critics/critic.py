"""The ``values`` batch input: a Megatron critic that scores every token and trains beside the policy.

A provider of the seam (stage ``learner``) that is also a step hook: before the policy update it
fills ``batch.values`` [T] with the critic's values (V_old, what GAE reads); after the policy's
optimizer steps it takes ``epochs`` optimizer steps of the value loss toward ``batch.returns`` (the
targets GAE wrote) on its own data-parallel share. The critic is the policy's architecture with a
scalar head (megarl.learner.value_model), under the run's TP/PP/EP layout, with its own Adam state,
initialised from the policy's initial weights (``init: policy``), randomly (``init: random``) or
from another HF checkpoint of the same architecture (``init: PATH``); its sharded state is
saved in every run checkpoint and restored on resume.

Knobs (``inputs.values.<knob>``): lr, value_loss (mse | clipped | huber), value_clip, huber_delta,
epochs, init (policy | random | an HF checkpoint directory), bounds ([low, high]: values squashed
into the reward range),
whiten_advantages (batch whitening of the advantages before the policy update), targets (estimator:
the returns the advantage estimator wrote | monte_carlo: the discounted reward-to-go, GAE with
λ = 1 | lambda: GAE returns over V_old with the critic's own λ ``lam``, decoupled from the actor's
``advantage.lam``), lam (the critic's λ of ``targets: lambda``, in [0, 1]), warmup_steps (the
first N RL steps train the critic only: the hook asks the trainer to skip the policy's optimizer
steps, ``updates_policy``), context (a privileged critic: it reads each prompt
with the ``critic_context`` round input appended, megarl.methods.critics.privileged), model
(critic: the Megatron critic above | trunk: a small head on the policy's own detached hidden
states, no second model: megarl.methods.critics.trunk, with layer, head_width, boundaries,
sarsa_coef and router | shared: a value head on the policy's trunk trained jointly with the policy
through the ``value_head`` regulariser, value gradients reaching the trunk:
megarl.methods.critics.shared).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megarl.advantages.estimators import gae, monte_carlo_returns, token_rewards, whiten
from megarl.batch import PackedBatch
from megarl.methods.critics.privileged import CONTEXT, context_rows, privileged_batch
from megarl.objectives.api import GlobalNormalisers
from megarl.objectives.value_losses import VALUE_LOSS_KINDS, ValueObjective
from megarl.plugin.inputs import InputProvider, register_provider
from megarl.plugin.knobs import Knobs


@dataclass
class CriticKnobs(Knobs):
    """See the module docstring."""

    lr: float = 1.0e-3
    value_loss: str = "clipped"
    value_clip: float = 0.2
    huber_delta: float = 1.0
    epochs: int = 1
    init: str = "policy"
    bounds: list | None = None
    whiten_advantages: bool = False
    targets: str = "estimator"
    lam: float = 1.0
    warmup_steps: int = 0
    context: bool = False
    model: str = "critic"
    layer: int = -1
    head_width: int = 64
    boundaries: bool = False
    sarsa_coef: float = 0.0
    router: bool = False

    def check(self) -> None:
        """Ranges and names."""
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be > 0")
        if self.value_loss not in VALUE_LOSS_KINDS:
            raise ValueError(f"value_loss={self.value_loss!r}; known: {', '.join(VALUE_LOSS_KINDS)}")
        if not self.value_clip > 0 or not self.huber_delta > 0:
            raise ValueError("value_clip and huber_delta must be > 0")
        if self.epochs < 1:
            raise ValueError(f"epochs={self.epochs} must be >= 1")
        if self.init not in ("policy", "random") and not os.path.isfile(
            os.path.join(self.init, "config.json")
        ):
            raise ValueError(
                f"init={self.init!r}: not policy, random or an HF checkpoint directory (no config.json there)"
            )
        if self.bounds is not None and (len(self.bounds) != 2 or not self.bounds[0] < self.bounds[1]):
            raise ValueError(f"bounds={self.bounds} must be [low, high] with low < high")
        if self.targets not in VALUE_TARGETS:
            raise ValueError(f"targets={self.targets!r}; known: {', '.join(VALUE_TARGETS)}")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"lam={self.lam} must be in [0, 1]")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0")
        if self.model not in VALUE_MODELS:
            raise ValueError(f"model={self.model!r}; known: {', '.join(VALUE_MODELS)}")
        if self.model == "critic" and (self.boundaries or self.sarsa_coef or self.router):
            raise ValueError(
                "boundaries, sarsa_coef and router need model: trunk (a head on the policy's trunk)"
            )
        if self.model == "shared":
            from megarl.methods.critics.shared import check_shared_knobs

            check_shared_knobs(self)
        if self.model == "trunk" and self.context:
            raise ValueError("context: true needs model: critic (the trunk reads the policy's own prompt)")
        if self.layer < -1 or self.head_width < 0 or self.sarsa_coef < 0:
            raise ValueError(
                f"layer={self.layer} (>= -1), head_width={self.head_width} (>= 0) and "
                f"sarsa_coef={self.sarsa_coef} (>= 0) out of range"
            )


VALUE_TARGETS: tuple[str, ...] = ("estimator", "monte_carlo", "lambda")
VALUE_MODELS: tuple[str, ...] = ("critic", "trunk", "shared")


def build_values(ctx: Any, knobs: CriticKnobs) -> Any:
    """The ``values`` part: the Megatron critic, a detached head on the policy's trunk (``model:
    trunk``) or the policy's own jointly trained value head (``model: shared``)."""
    from megarl.methods.critics.shared import HEAD, SharedValues

    if knobs.model == "shared":
        return SharedValues(ctx, knobs)
    if HEAD in getattr(getattr(ctx.policy, "cfg", None), "heads", ()):
        raise ValueError(
            f"objective.regularisers: value_head trains a value head on the policy's trunk, but "
            f"inputs.values.model={knobs.model!r} fills the values from another model; set "
            "inputs.values.model: shared"
        )
    if knobs.model == "trunk":
        from megarl.methods.critics.trunk import TrunkCritic

        return TrunkCritic(ctx, knobs)
    return Critic(ctx, knobs)


def value_targets(
    batch: PackedBatch, targets: str, gamma: float = 1.0, lam: float = 1.0
) -> torch.Tensor | None:
    """The critic's regression targets [T]: the estimator's returns (``batch.returns``, None when
    it wrote none), the Monte Carlo return (``monte_carlo_returns``) or the λ-return of GAE over
    ``batch.values`` with the critic's own ``lam`` (``lambda``: Â^{γ,λ_c} + V_old, whatever λ the
    actor's advantages use); in the dtype of the values."""
    if targets == "estimator":
        return batch.returns
    if targets not in VALUE_TARGETS:
        raise ValueError(f"inputs.values.targets={targets!r}; known: {', '.join(VALUE_TARGETS)}")
    dtype = batch.values.dtype if batch.values is not None else torch.float32
    if targets == "monte_carlo":
        return monte_carlo_returns(batch, gamma).to(dtype)
    if batch.values is None:
        raise ValueError("inputs.values.targets: lambda needs the batch field 'values' (V_old)")
    m = batch.loss_mask.double()
    _, ret = gae(token_rewards(batch), batch.values.double(), m, batch.cu_seqlens, gamma, lam)
    return ret.to(dtype)


class Critic:
    """The critic learner with its fill (values) and hook (training) sides; see the module docstring."""

    def __init__(self, ctx: Any, knobs: CriticKnobs):
        from megarl.learner.value_model import build_value_learner

        cfg = ctx.cfg
        optim = dataclasses.replace(cfg.optimizer, lr=knobs.lr, min_lr=0.0)
        self.learner = build_value_learner(
            ctx.hf_config,
            ctx.groups,
            optim,
            {"policy": str(ctx.init_dir), "random": None}.get(knobs.init, knobs.init),
            torch.bfloat16 if cfg.model.params_dtype == "bfloat16" else torch.float32,
            cfg.model.seed + 1,
            tuple(knobs.bounds) if knobs.bounds is not None else None,
        )
        self.knobs, self.ctx = knobs, ctx
        self.objective = ValueObjective(knobs.value_loss, knobs.value_clip, knobs.huber_delta)
        self.micro_batches = cfg.schedule.micro_batches
        self._batch: PackedBatch | None = None
        # round inputs this part reads (the run builds their providers)
        self.needs_inputs: tuple[str, ...] = (CONTEXT,) if knobs.context else ()

    # ---------------------------------------------------------------- input provider
    def fill(self, batch: PackedBatch, micro_batches: int) -> dict[str, float]:
        """``batch.values`` [T] from the critic (collective)."""
        from megarl.learner.value_model import compute_values

        if self.knobs.context:  # values of the critic's own sequences, back at the policy's tokens
            seen, index = privileged_batch(batch, context_rows(batch))
            batch.values = compute_values(self.learner, seen, micro_batches)[index]
        else:
            batch.values = compute_values(self.learner, batch, micro_batches)
        m = batch.loss_mask.bool()
        return {"critic/values_old": float(batch.values[m].mean()) if bool(m.any()) else 0.0}

    # ---------------------------------------------------------------- step hook
    def updates_policy(self, step: int) -> bool:
        """False during the critic's warm-up (RL steps 1..warmup_steps): the policy stays as it is."""
        return step > self.knobs.warmup_steps

    def before_train(self, step: int, batch: PackedBatch) -> PackedBatch:
        """Keep the batch (values, targets) for the critic's update; whiten advantages if asked."""
        gamma = float(self.ctx.cfg.advantage.knobs.get("gamma", 1.0))
        batch.returns = value_targets(batch, self.knobs.targets, gamma, self.knobs.lam)
        if batch.returns is None:
            raise ValueError(
                "inputs.values: the critic trains toward batch.returns, which this run's advantage "
                "estimator does not write (use advantage.estimator: gae, or inputs.values.targets: "
                "monte_carlo)"
            )
        if self.knobs.whiten_advantages:
            batch.advantages = whiten(batch.advantages, batch.loss_mask)
        self._batch = privileged_batch(batch, context_rows(batch))[0] if self.knobs.context else batch
        return batch

    def after_step(self, step: int, metrics: dict) -> dict[str, float]:
        """``epochs`` critic optimizer steps on this replica's share; their last metrics."""
        batch, self._batch = self._batch, None
        if batch is None:
            return {}
        local = self.ctx.dp_share(batch)
        norms = GlobalNormalisers.from_batch(local, self.ctx.dp_group)
        micro = max(1, min(self.micro_batches, local.num_seqs))
        out: dict[str, float] = {}
        for _ in range(self.knobs.epochs):
            out = self.learner.train_step(local, self.objective, micro, norms)
        m = batch.loss_mask.bool()
        ret, old = batch.returns[m].double(), batch.values[m].double()
        var = float(ret.var()) if ret.numel() > 1 else 0.0
        explained = 1.0 - float((ret - old).var()) / var if var > 0 else 0.0
        keep = ("value_loss", "value_clipfrac", "value_mean", "value_abs_error", "grad_norm", "lr")
        res = {f"critic/{k}": out[k] for k in keep if k in out}
        res["critic/explained_variance"] = explained
        if self.knobs.warmup_steps:
            res["critic/warmup"] = float(not self.updates_policy(step))
        return res

    def state_dict(self) -> dict:
        """Nothing beside the sharded state (``save_sharded``)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing beside the sharded state (``load_sharded``)."""

    def save_sharded(self, directory: Path) -> None:
        """The critic's model, optimizer and scheduler (collective)."""
        from megarl.learner.dist_checkpoint import save_checkpoint

        save_checkpoint(self.learner, directory)

    def load_sharded(self, directory: Path) -> None:
        """Restore ``save_sharded`` (collective; any layout)."""
        from megarl.learner.dist_checkpoint import load_checkpoint

        load_checkpoint(self.learner, directory)


VALUES = register_provider(
    InputProvider(
        ("values",),
        "learner",
        lambda ctx, names: build_values(ctx, ctx.knobs),
        knobs=CriticKnobs,
        summary="a Megatron critic (value head on the policy's architecture), trained beside the policy",
    )
)
