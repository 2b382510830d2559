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
    # more rejection criteria multiplied onto the correction: [{"name": <criterion>, "high": float,
    # "low": float (icepop, seq_geo_mask; default correction_low)}]
    correction_chain: list = field(default_factory=list)
    # divide the correction by its mean over the global batch's loss tokens (seq_tis: over sequences)
    correction_normalise: bool = False
    # rejected tokens: "keep" them in the loss denominators (masked IS) or "drop" them from it
    correction_denominator: str = "keep"
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
        self._validate_correction()
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

    def _validate_correction(self) -> None:
        from megarl.objectives.corrections import CRITERIA

        if not isinstance(self.correction_chain, list):
            raise ValueError(f"objective.correction_chain must be a list, got {self.correction_chain!r}")
        for i, crit in enumerate(self.correction_chain):
            key = f"objective.correction_chain[{i}]"
            if not isinstance(crit, dict) or crit.get("name") not in CRITERIA or "high" not in crit:
                raise ValueError(
                    f"{key} must be a mapping with 'name' (one of {', '.join(CRITERIA)}) "
                    f"and 'high', got {crit!r}"
                )
            extra = set(crit) - {"name", "high", "low"}
            if extra:
                raise ValueError(f"{key} has unknown keys {sorted(extra)}; allowed: name, high, low")
            for k in ("high", "low"):
                v = crit.get(k, 0.0)
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ValueError(f"{key}.{k}={v!r} must be a number")
        if not isinstance(self.correction_normalise, bool):
            raise ValueError(
                f"objective.correction_normalise={self.correction_normalise!r} must be true or false"
            )
        if self.correction_denominator not in ("keep", "drop"):
            raise ValueError(
                f"objective.correction_denominator={self.correction_denominator!r}; allowed: keep, drop"
            )
        uses = self.correction_normalise or self.correction_denominator != "keep"
        if uses and self.correction == "none" and not self.correction_chain:
            raise ValueError(
                "objective.correction_normalise / correction_denominator need a correction "
                "or a correction_chain"
            )
