"""The objective's config section: plain data, no torch import at module load (the trainer's config
loads it as its ``objective`` section before anything heavy; ``validate`` imports the part registries)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ObjectiveConfig:
    """Knobs of the composed objective (names are registry keys)."""

    policy_loss: str = "ppo"
    # None: the policy loss's own default (PPO 0.2/0.28, GSPO 3e-4/4e-4, CISPO 1e9/0.28, ...)
    clip_low: float | None = None
    clip_high: float | None = None
    dual_clip: float | None = None
    aggregation: str = "token-mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    correction: str = "none"
    correction_low: float = 0.5
    correction_high: float = 2.0
    distill: str = "none"
    distill_coef: float = 0.0
    # extra keyword knobs of the chosen policy loss (method families register losses that need more)
    policy_loss_args: dict = field(default_factory=dict)
    # extra loss terms: [{"name": <REGULARISERS key>, "coef": float, <knobs>...}],
    # each aggregated like the rest
    regularisers: list = field(default_factory=list)

    def validate(self) -> ObjectiveConfig:
        """Fail early with the offending key and the allowed values."""
        from megarl.objectives.aggregation import MODES
        from megarl.objectives.corrections import CORRECTIONS
        from megarl.objectives.distillation import DISTILLATION
        from megarl.objectives.kl import KL_ESTIMATORS
        from megarl.objectives.policy_losses import POLICY_LOSSES
        from megarl.objectives.regularisers import REGULARISERS

        for key, reg in (
            ("policy_loss", POLICY_LOSSES),
            ("kl_estimator", KL_ESTIMATORS),
            ("correction", CORRECTIONS),
            ("distill", DISTILLATION),
        ):
            if getattr(self, key) not in reg:
                raise ValueError(f"objective.{key}={getattr(self, key)!r}; allowed: {', '.join(reg.names())}")
        for key in ("clip_low", "clip_high"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"objective.{key}={v!r} must be a number or null (the loss's own default)")
        for key in ("kl_coef", "entropy_coef", "correction_low", "correction_high", "distill_coef"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(
                    f"objective.{key}={v!r} must be a number (YAML reads 1.0e9 as a string: write 1.0e+9)"
                )
        if self.dual_clip is not None and (
            isinstance(self.dual_clip, bool)
            or not isinstance(self.dual_clip, (int, float))
            or self.dual_clip <= 1
        ):
            raise ValueError(f"objective.dual_clip={self.dual_clip!r} must be a number > 1 or null")
        if self.aggregation not in MODES:
            raise ValueError(f"objective.aggregation={self.aggregation!r}; allowed: {', '.join(MODES)}")
        if not isinstance(self.policy_loss_args, dict):
            raise ValueError(f"objective.policy_loss_args must be a mapping, got {self.policy_loss_args!r}")
        for i, reg in enumerate(self.regularisers):
            if not isinstance(reg, dict) or "name" not in reg or "coef" not in reg:
                raise ValueError(
                    f"objective.regularisers[{i}] must be a mapping with 'name' and 'coef', got {reg!r}"
                )
            if reg["name"] not in REGULARISERS:
                # the families register their parts when the catalogue loads them
                raise ValueError(
                    f"objective.regularisers[{i}].name={reg['name']!r}; allowed: "
                    f"{', '.join(REGULARISERS.names()) or 'none registered'}"
                )
        return self
