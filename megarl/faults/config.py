"""The ``faults:`` section of a run config: injections, detector knobs, step dumps.

Loaded by megarl.trainer.config like every other section (unknown keys and wrong types fail at
start naming the dotted key); ``validate_faults`` adds the cross-field checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

INJECTION_KINDS = ("nan", "inf", "fp16", "bf16", "logits", "poison", "lr")
EVENT_TYPES = (
    "nonfinite",
    "loss_spike",
    "grad_norm_spike",
    "update_drift_spike",
    "logprob_gap",
    "entropy_collapse",
    "router_collapse",
    "load_imbalance",
)


@dataclass
class InjectionConfig:
    """One injected fault, active during the train forward/backward of trainer step ``step``.

    kind:
      - ``nan`` / ``inf``: write NaN / +Inf into the output of module ``target`` (``where: output``),
        into the gradient of parameter ``target`` (``where: grad``), or into the values of parameter
        ``target`` or of every parameter of module ``target`` for the step (``where: weight``,
        restored after it); ``fraction`` of the elements (at least one), chosen with ``seed``.
      - ``fp16``: module ``target`` computes in float16 (parameters and inputs cast) and its output and the
        gradient flowing back into it are stored in float16; the gradient is multiplied by
        ``loss_scale`` before the cast and divided after (an emulated static loss scale), so a
        scale too large overflows exactly like an fp16 loss-scaled backward.
      - ``bf16``: module ``target`` computes in bfloat16 the same way, output cast back.
      - ``logits``: the output layer's logits become ``logits * scale + noise * N(0, 1)``.
      - ``poison``: the batch handed to the learner is corrupted: ``field: advantages`` multiplies
        the advantages by ``scale``; ``field: tokens`` replaces ``fraction`` of the response
        tokens with random ids (the logprobs recorded for them no longer match).
      - ``lr``: a learning-rate spike: the step's optimizer steps use ``scale`` x the scheduled LR.

    ``expert`` (>= 0): ``target`` names a MoE layer (``decoder.layers.0.mlp``) and the fault goes
    into its routed expert ``expert`` (the global id, 0..E-1), on the expert-parallel rank that
    holds it only; the other ranks do nothing.
    """

    kind: Literal["nan", "inf", "fp16", "bf16", "logits", "poison", "lr"] = "nan"
    step: int = 1
    target: str = ""
    where: Literal["output", "grad", "weight"] = "output"
    fraction: float = 0.0
    loss_scale: float = 1.0
    scale: float = 1.0
    noise: float = 0.0
    field: Literal["advantages", "tokens"] = "advantages"
    seed: int = 0
    expert: int = -1


@dataclass
class DetectorConfig:
    """Knobs of the per-step detectors (docs/faults.md). A threshold of 0 turns its detector off.

    Spikes: an exponential moving average of the value and of its squared deviation
    (``spike_beta``) gives a baseline mean and std; after ``spike_warmup`` steps a value with
    z = (x - mean) / max(std, spike_min_rel_std * |mean|, spike_min_abs_std) above ``spike_z`` is a
    spike (the absolute floor keeps float noise of a loss that is ~0 by construction, e.g. PPO at
    ratio 1 with group-normalised advantages, from counting as spikes). Spike values do not update
    the baseline.
    """

    skip_nonfinite: bool = True
    spike_z: float = 6.0
    spike_beta: float = 0.8
    spike_warmup: int = 3
    spike_min_rel_std: float = 0.05
    spike_min_abs_std: float = 1.0e-4
    logprob_gap_max: float = 0.5
    entropy_min: float = 0.0
    entropy_drop_frac: float = 0.1
    router_imbalance_max: float = 0.0
    router_entropy_min: float = 0.3


@dataclass
class FaultsConfig:
    """Fault tooling of a run. Detectors run every step when ``detect`` is true (the default)."""

    detect: bool = True
    inject: list = field(default_factory=list)
    detectors: DetectorConfig = field(default_factory=DetectorConfig)
    dump_on: list = field(default_factory=list)  # event types that trigger a step dump
    dump_steps: list = field(default_factory=list)  # trainer steps dumped unconditionally
    dump_learner_state: bool = True  # dump_steps: also the full learner state before the step
    dump_dir: str = ""  # default: run_dir/dumps
    max_dumps: int = 5


def validate_faults(cfg: FaultsConfig) -> None:
    """Cross-field checks; raises ValueError naming the ``faults.`` key."""
    for i, inj in enumerate(cfg.inject):
        key = f"faults.inject[{i}]"
        if inj.step < 1:
            raise ValueError(f"{key}.step={inj.step} must be >= 1 (trainer steps start at 1)")
        if inj.kind in ("nan", "inf", "fp16", "bf16") and not inj.target:
            raise ValueError(
                f"{key}.target is required for kind {inj.kind!r} (a module name such as "
                f"'decoder.layers.0.mlp', or a parameter name with where: grad)"
            )
        if inj.where in ("grad", "weight") and inj.kind not in ("nan", "inf"):
            raise ValueError(f"{key}.where={inj.where!r} is only for kinds 'nan' and 'inf'")
        if inj.expert >= 0 and inj.kind not in ("nan", "inf", "fp16", "bf16"):
            raise ValueError(f"{key}.expert is only for kinds nan, inf, fp16 and bf16 (a module fault)")
        if inj.expert >= 0 and inj.where == "grad":
            raise ValueError(
                f"{key}.expert with where: grad; use where: weight or output (an expert is a module)"
            )
        if inj.expert < -1:
            raise ValueError(f"{key}.expert={inj.expert} must be a routed expert id >= 0 (-1 = none)")
        if inj.kind == "lr" and inj.scale <= 0:
            raise ValueError(f"{key}.scale={inj.scale} must be > 0 for an lr spike")
        if not 0.0 <= inj.fraction <= 1.0:
            raise ValueError(f"{key}.fraction={inj.fraction} must be in [0, 1]")
        if inj.loss_scale <= 0:
            raise ValueError(f"{key}.loss_scale={inj.loss_scale} must be > 0")
        if inj.kind == "poison" and inj.field == "tokens" and inj.fraction == 0.0:
            raise ValueError(f"{key}: poison of tokens needs fraction > 0")
    for i, t in enumerate(cfg.dump_on):
        if t not in EVENT_TYPES:
            raise ValueError(f"faults.dump_on[{i}]={t!r}; allowed: {', '.join(EVENT_TYPES)}")
    for i, s in enumerate(cfg.dump_steps):
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"faults.dump_steps[{i}]={s!r} must be a step number >= 1")
    if cfg.max_dumps < 0:
        raise ValueError(f"faults.max_dumps={cfg.max_dumps} must be >= 0")
    d = cfg.detectors
    if not 0.0 < d.spike_beta < 1.0:
        raise ValueError(f"faults.detectors.spike_beta={d.spike_beta} must be in (0, 1)")
    if d.spike_warmup < 1:
        raise ValueError(f"faults.detectors.spike_warmup={d.spike_warmup} must be >= 1")


# What each key of the faults section means (the configuration reference, docs/configuration.md).
FIELD_MEANINGS: dict[str, str] = {
    "faults.detect": "run the per-step detectors (docs/faults.md)",
    "faults.inject": "injected faults (list of faults.inject[] entries below)",
    "faults.detectors.skip_nonfinite": "skip an optimizer step whose gradients are not finite",
    "faults.detectors.spike_z": "z-score above which a loss / grad-norm value is a spike (0 = off)",
    "faults.detectors.spike_beta": "EMA factor of the spike baseline",
    "faults.detectors.spike_warmup": "steps before spikes are reported",
    "faults.detectors.spike_min_rel_std": "floor of the baseline std, relative to |mean|",
    "faults.detectors.spike_min_abs_std": (
        "absolute floor of the baseline std (float rounding of a ~0 loss is no spike)"
    ),
    "faults.detectors.logprob_gap_max": "train/rollout logprob gap above which an event is raised (0 = off)",
    "faults.detectors.entropy_min": "entropy below which a collapse is reported (0 = off)",
    "faults.detectors.entropy_drop_frac": "entropy falling below this fraction of its baseline is a collapse",
    "faults.detectors.router_imbalance_max": (
        "MoE expert-load imbalance above which an event is raised (0 = off)"
    ),
    "faults.detectors.router_entropy_min": (
        "normalised router entropy below which a router collapse is reported"
    ),
    "faults.max_dumps": "maximum number of step dumps per run",
    "faults.inject[].kind": "fault kind (see docs/faults.md): nan, inf, fp16, bf16, logits, poison, lr",
    "faults.inject[].step": "trainer step during whose forward/backward the fault is active",
    "faults.inject[].target": "module name (output, weight; a MoE layer with expert) or parameter name",
    "faults.inject[].where": "nan/inf into a module's output, a parameter's gradient or weights (one step)",
    "faults.inject[].fraction": "fraction of elements (nan/inf) or response tokens (poison tokens) hit",
    "faults.inject[].loss_scale": "emulated static loss scale of an fp16 module",
    "faults.inject[].scale": "multiplier of the logits, the advantages (poison) or the learning rate (lr)",
    "faults.inject[].noise": "std of the Gaussian added to the logits (kind logits)",
    "faults.inject[].field": "what a poison corrupts: advantages or tokens",
    "faults.inject[].seed": "seed of the element / token choice",
    "faults.inject[].expert": "routed expert (global id) of the MoE layer target; -1: the whole target",
}
