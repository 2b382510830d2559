"""3PO: rollouts from parameter-perturbed policies, trained with GRPO (reconstructed).

Every weight sync pushes ``θ + σ·ε(seed_v)`` to the rollout engine (``v`` the policy version; the
learner keeps θ, restored bit for bit after the export: megarl/methods/gradients/perturbation.py),
so the rollouts of step ``v + 1`` come from one posterior sample around θ_v. The loss is GRPO's
PPO-clip with the truncated importance weight ``min(π_θold / π_θ̃, C)`` (``objective.correction:
tis``, ``correction_high: C``, set in examples/methods/3po.yaml): the engine's log-probs are the
perturbed policy's. With σ = 0 the engine gets θ bit for bit and the run is GRPO with the same
objective section.

Every sample carries its perturbation id (``extras['perturbation_id']``, the noise seed of the
weights that generated it); the step logs ``3po/perturbation_id`` and ``3po/sigma``, and the
fraction of zero-advantage groups is the collector's ``rollout/zero_var_group_frac``.

Provenance: reconstructed from the 3PO abstract (perturbed-parameter policies, the noise scale as
a lever complementary to temperature) and PSN-RLVR (arXiv 2602.02555: perturb before rollout,
truncated IS for the sampling/update mismatch). This builds one perturbation per step (K = 1 per
group: every group of a step is sampled from the same θ̃); the posterior scale is the identity.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from megarl.methods.gradients.noise import tensor_key
from megarl.methods.gradients.perturbation import WeightPerturbation
from megarl.plugin.knobs import Knobs
from megarl.plugin.rounds import RolloutRound, RoundResult
from megarl.plugin.spec import MethodParts, MethodSpec


@dataclass
class ThreePOKnobs(Knobs):
    """sigma: the noise scale σ of ``θ̃ = θ + σε``; seed: the run's noise seed (the perturbation
    of version v is seeded by (seed, v))."""

    sigma: float = 1e-3
    seed: int = 0

    def check(self) -> None:
        """σ >= 0, seed >= 0."""
        if self.sigma < 0:
            raise ValueError(f"method.sigma={self.sigma} must be >= 0")
        if self.seed < 0:
            raise ValueError(f"method.seed={self.seed} must be >= 0")


def perturbation_id(seed: int, version: int) -> int:
    """The noise seed of policy version ``version`` (a 31-bit id, recorded on its samples)."""
    k0, k1 = tensor_key(seed, f"3po/version/{version}")
    return (k0 ^ k1) & 0x7FFFFFFF


class PerturbedRollouts:
    """The step hook (every rank): every weight sync of version v runs with θ + σ·ε(id(v))."""

    def __init__(
        self, perturbation: WeightPerturbation | Callable[[], WeightPerturbation], knobs: ThreePOKnobs
    ):
        """``perturbation``: the learner's ``WeightPerturbation``, or a function making it at first use."""
        self._perturbation, self.knobs = perturbation, knobs
        self.last_id: int | None = None

    @property
    def perturbation(self) -> WeightPerturbation:
        """The learner's perturbation (made at first use)."""
        if not isinstance(self._perturbation, WeightPerturbation):
            self._perturbation = self._perturbation()
        return self._perturbation

    @contextlib.contextmanager
    def rollout_weights(self, version: int) -> Iterator[None]:
        """Perturb for the export of ``version``, restore after it."""
        self.last_id = perturbation_id(self.knobs.seed, version)
        if self.knobs.sigma == 0.0:  # θ + 0·ε is θ: skip the work, the engine gets θ bit for bit
            yield
            return
        with self.perturbation.applied(self.last_id, self.knobs.sigma):
            yield

    def before_train(self, step, batch):
        """Nothing before the update."""
        return batch

    def after_step(self, step: int, metrics: dict) -> dict[str, float]:
        """σ and the id of the weights the step's rollouts came from."""
        return {"3po/sigma": self.knobs.sigma}

    def state_dict(self) -> dict:
        """Nothing to save: ids are a function of (seed, version)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore."""


class PerturbationIds:
    """Rank 0's round processor: stamps every sample of a round with the id of the weights that
    generated it (synchronous loop: the rollouts of step s come from the sync of version s − 1)."""

    def __init__(self, knobs: ThreePOKnobs):
        self.knobs = knobs

    async def process(self, r: RolloutRound) -> RoundResult:
        """``extras['perturbation_id']`` for every sample of ``r``."""
        pid = perturbation_id(self.knobs.seed, r.step - 1)
        return RoundResult(
            extras={"perturbation_id": [float(pid)] * len(r.texts)},
            metrics={"3po/perturbation_id": float(pid)},
        )

    def state_dict(self) -> dict:
        """Stateless."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Stateless."""


def check_sync_loop(cfg, method: str) -> None:
    """Refuse the asynchronous loop (its samples mix versions the round cannot name)."""
    if cfg.async_loop.enabled:
        raise ValueError(f"method {method} needs the synchronous loop: set async_loop.enabled: false")


def build(ctx, knobs: ThreePOKnobs) -> MethodParts:
    """The perturbing step hook on every rank, the id stamper on rank 0."""
    check_sync_loop(ctx.cfg, "3po")
    hook = PerturbedRollouts(lambda: WeightPerturbation.of_model(ctx.policy.model, ctx.groups), knobs)
    return MethodParts(round_processors=[PerturbationIds(knobs)], step_hooks=[hook])


SPEC = MethodSpec(
    name="3po",
    summary="GRPO on rollouts from perturbed weights θ + σε (seeded per policy version), truncated IS",
    provenance="reconstructed",
    config={"advantage": {"estimator": "grpo"}},
    knobs=ThreePOKnobs,
    build=build,
)
