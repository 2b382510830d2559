"""The run's method machinery, composed from registered parts; the trainer never names a method.

``required_inputs`` reads what the configured parts declare (``PartInfo.batch_inputs``; a KL or
distillation coefficient needs its frozen model's input; the method spec's own ``inputs``).
``MethodRuntime`` holds, per run: the advantage stage (estimator + its state), the learner passes
and batch fillers of the required inputs, rank 0's round processors (the reward shaper, round
providers, the method's own), the step hooks, and their checkpoint state. It is built in two
phases, because learner passes must exist before the rollout engine and round processors need it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.batch import PackedBatch
from megarl.objectives.distillation import DISTILLATION
from megarl.objectives.policy_losses import POLICY_LOSSES
from megarl.objectives.regularisers import REGULARISERS
from megarl.plugin.inputs import INPUT_PROVIDERS, RolloutInfo, provider_for
from megarl.plugin.knobs import build_knobs
from megarl.plugin.spec import BatchExtender, MethodParts, PolicyGate, ShardedState, StepHook


@runtime_checkable
class ReportsMetrics(Protocol):
    """A part state with per-step diagnostics."""

    def metrics(self) -> dict[str, float]: ...


def required_inputs(cfg: Any, spec: Any = None) -> dict[str, str]:
    """Batch inputs the run's parts need beyond the core batch: name -> the part that asked first."""
    need: dict[str, str] = {}

    def add(names, who: str) -> None:
        for n in names:
            need.setdefault(n, who)

    a = cfg.advantage.estimator
    add(ADVANTAGE_ESTIMATORS.info(a).batch_inputs, f"advantage.estimator={a}")
    o = cfg.objective
    add(POLICY_LOSSES.info(o.policy_loss).batch_inputs, f"objective.policy_loss={o.policy_loss}")
    for reg in o.regularisers:
        add(REGULARISERS.info(reg["name"]).batch_inputs, f"objective.regularisers: {reg['name']}")
    if o.kl_coef:
        add(("ref_logprobs",), "objective.kl_coef")
    if o.distill != "none":
        add(DISTILLATION.info(o.distill).batch_inputs, f"objective.distill={o.distill}")
    if spec is not None:
        add(spec.inputs, f"method {spec.name}")
    return need


def provider_knobs(cfg: Any, provider: Any) -> Any:
    """A provider's knobs from ``inputs.<name>`` (the first of its names the config sets)."""
    raw, where = {}, f"inputs.{provider.provides[0]}"
    for name in provider.provides:
        if name in cfg.inputs:
            raw, where = cfg.inputs[name], f"inputs.{name}"
            break
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping of knobs, got {raw!r}")
    return build_knobs(provider.knobs, raw, where)


def check_inputs_section(cfg: Any) -> None:
    """Every ``inputs.<name>`` names a known input and its knobs are valid."""
    for name in cfg.inputs:
        provider_knobs(cfg, provider_for(name, f"inputs.{name}"))


def _own_part(obj: Any) -> bool:
    """Whether ``obj`` (a registered function or a provider's build) is defined in megarl's core
    packages, whose reads of the batch are known, rather than in ``megarl.methods``."""
    module = getattr(obj, "__module__", "") or ""
    return module.startswith("megarl.") and not module.startswith("megarl.methods")


def old_logprobs_from_forward(cfg: Any, inputs: dict[str, str], spec: Any = None) -> bool:
    """Whether the PPO ratio's old logprobs can be the training forward's, detached, instead of a
    second forward pass before the update (``schedule.old_logprobs: recompute``): exactly one
    optimizer step per batch (one epoch, one mini-batch), so the weights of that forward are the
    ones a recomputation would use; no part reads the old logprobs before the update (none
    declares them, no rollout correction, no estimator KL term, no method spec and only core
    parts: a method's parts may read them without declaring); no fault injection (an injected
    fault changes the batch after its old logprobs were taken, and reproducing it later needs those
    logprobs). Loss and gradient are the same."""
    s, o = cfg.schedule, cfg.objective
    if s.old_logprobs != "recompute" or s.ppo_epochs != 1 or s.mini_batches != 1:
        return False
    if cfg.faults.inject:
        return False
    if spec is not None or "old_logprobs" in inputs or o.correction != "none":
        return False
    if cfg.advantage.knobs.get("kl_coef"):  # an estimator's reward KL uses the old logprobs
        return False
    parts = [ADVANTAGE_ESTIMATORS.get(cfg.advantage.estimator), POLICY_LOSSES.get(o.policy_loss)]
    parts += [REGULARISERS.get(r["name"]) for r in o.regularisers]
    if o.distill != "none":
        parts.append(DISTILLATION.get(o.distill))
    parts += [p.build for p, _ in _providers(inputs)]
    return all(_own_part(p) for p in parts)


class AdvantageStage:
    """The configured estimator with its knobs and state (e.g. an entropy history), made once per run."""

    def __init__(self, cfg: Any):
        self.name = cfg.advantage.estimator
        self.fn = ADVANTAGE_ESTIMATORS.get(self.name)
        self.knobs = dict(cfg.advantage.knobs)
        make_state = ADVANTAGE_ESTIMATORS.info(self.name).make_state
        self.state = make_state(**self.knobs) if make_state is not None else None

    def __call__(self, batch: PackedBatch) -> torch.Tensor:
        """Fill ``batch.advantages`` [T] (float32)."""
        kw = dict(self.knobs)
        if self.state is not None:
            kw["state"] = self.state
        batch.advantages = self.fn(batch, **kw).to(torch.float32)
        return batch.advantages

    def metrics(self) -> dict[str, float]:
        """The state's diagnostics, when it reports any."""
        return self.state.metrics() if isinstance(self.state, ReportsMetrics) else {}


@dataclass
class MethodRuntime:
    """See the module docstring. ``inputs``: required input -> who asked."""

    inputs: dict[str, str]
    advantages: AdvantageStage
    learner_passes: list = field(default_factory=list)
    batch_fillers: list = field(default_factory=list)
    round_processors: list = field(default_factory=list)
    step_hooks: list = field(default_factory=list)
    allocator: Any = None  # the method's rollout allocator (rank 0), None: the configured one
    old_from_forward: bool = False  # old logprobs from the training forward (old_logprobs_from_forward)
    batch_source: Any = None  # the method's BatchSource (every rank), None: train on rollouts
    workflow_parts: dict = field(default_factory=dict)  # what the rollout workflow may use (rank 0)

    # ------------------------------------------------------------------ building
    @staticmethod
    def build_learner_side(ctx: Any, spec: Any = None) -> MethodRuntime:
        """Phase 1 (every rank, before the engine): learner passes and batch fillers."""
        cfg = ctx.cfg
        inputs = required_inputs(cfg, spec)
        wanted = dict(inputs)
        rt = MethodRuntime(inputs=inputs, advantages=AdvantageStage(cfg))
        rt.old_from_forward = old_logprobs_from_forward(cfg, inputs, spec)
        if cfg.schedule.old_logprobs == "recompute" and not rt.old_from_forward:
            wanted = {"old_logprobs": "schedule.old_logprobs=recompute", **wanted}
        for provider, names in _providers(wanted):
            if provider.stage == "round":
                continue
            built = provider.build(ctx.with_knobs(provider_knobs(ctx.cfg, provider)), frozenset(names))
            (rt.learner_passes if provider.stage == "learner" else rt.batch_fillers).append(built)
            if isinstance(built, StepHook):  # a provider that also trains a model of its own
                rt.step_hooks.append(built)
            for n in getattr(built, "needs_inputs", ()):  # round inputs it reads (built in phase 2)
                rt.inputs.setdefault(n, f"inputs.{provider.provides[0]}")
        if rt.old_from_forward and rt.step_hooks:  # a hook may change the batch before the update
            rt.old_from_forward = False
            provider = provider_for("old_logprobs", "schedule.old_logprobs=recompute")
            rt.learner_passes.insert(0, provider.build(ctx, frozenset({"old_logprobs"})))
        return rt

    def build_rank0_side(self, ctx: Any, spec: Any = None, method_knobs: Any = None) -> None:
        """Phase 2 (after the engine): round processors (rank 0) and the method's own parts."""
        cfg = ctx.cfg
        if ctx.rank0 and cfg.reward.shaping is not None:
            from megarl.rewards.shaping.processor import ShapingProcessor

            self.round_processors.append(ShapingProcessor(ctx))
        if ctx.rank0:
            for provider, names in _providers(self.inputs):
                if provider.stage == "round":
                    self.round_processors.append(
                        provider.build(ctx.with_knobs(provider_knobs(ctx.cfg, provider)), frozenset(names))
                    )
        if spec is not None and spec.build is not None:
            parts: MethodParts = spec.build(ctx, method_knobs)
            if ctx.rank0:
                self.round_processors += parts.round_processors
                self.allocator = parts.allocator
                self.workflow_parts = dict(parts.workflow_parts)
            self.step_hooks += parts.step_hooks
            self.batch_source = parts.batch_source

    def close(self) -> None:
        """Close every part that holds resources of its own (clients, event loops, open
        files): each built part with a ``close()``, once, in build order."""
        seen: set[int] = set()
        for part in [
            *self.learner_passes,
            *self.batch_fillers,
            *self.round_processors,
            *self.step_hooks,
            self.allocator,
            self.batch_source,
        ]:
            if part is not None and id(part) not in seen and callable(getattr(part, "close", None)):
                seen.add(id(part))
                part.close()

    # ------------------------------------------------------------------ using
    def fill_learner_inputs(self, batch: PackedBatch, micro_batches: int) -> dict[str, float]:
        """Run every learner pass (collective)."""
        out: dict[str, float] = {}
        for p in self.learner_passes:
            out.update(p.fill(batch, micro_batches))
        return out

    @staticmethod
    def add_round_extras(batch: PackedBatch, info: RolloutInfo) -> None:
        """Per-sample extras made on rank 0 into ``batch.extras`` (float64)."""
        for k, v in info.extras.items():
            batch.extras[k] = torch.as_tensor(v, dtype=torch.float64)

    def extend_batch(
        self, step: int, batch: PackedBatch, info: RolloutInfo
    ) -> tuple[PackedBatch, RolloutInfo]:
        """Every step hook that is a ``BatchExtender``, in order (every rank; collective), then the
        round extras of the extended batch."""
        extenders = [h for h in self.step_hooks if isinstance(h, BatchExtender)]
        for h in extenders:
            batch, info = h.extend_batch(step, batch, info)
        if extenders:
            self.add_round_extras(batch, info)
        return batch, info

    def fill_batch_inputs(self, batch: PackedBatch, info: RolloutInfo) -> dict[str, float]:
        """Per-sample extras made on rank 0 into ``batch.extras`` (float64), then every batch filler."""
        self.add_round_extras(batch, info)
        out: dict[str, float] = {}
        for f in self.batch_fillers:
            out.update(f.fill(batch, info))
        missing = [n for n in self.inputs if INPUT_PROVIDERS[n].stage == "round" and n not in batch.extras]
        if missing:
            raise ValueError(f"the rollouts carry no {missing[0]!r} (needed by {self.inputs[missing[0]]})")
        return out

    def updates_policy(self, step: int) -> bool:
        """False when a step hook holds the policy still this step (``PolicyGate``)."""
        return all(h.updates_policy(step) for h in self.step_hooks if isinstance(h, PolicyGate))

    # ------------------------------------------------------------------ checkpoints
    def sharded_parts(self) -> list[tuple[str, ShardedState]]:
        """The step hooks with sharded state, each with its folder name in a run checkpoint."""
        return [(f"hook_{i}", h) for i, h in enumerate(self.step_hooks) if isinstance(h, ShardedState)]

    def load_sharded(self, ckpt: Any) -> None:
        """Load every sharded part from run checkpoint ``ckpt`` (collective)."""
        for name, part in self.sharded_parts():
            part.load_sharded(ckpt / name)

    def state_dict(self) -> dict:
        """The estimator's state, every round processor's and hook's, the method allocator's and
        batch source's (rank 0's view)."""
        out = {
            "estimator": None if self.advantages.state is None else self.advantages.state.state_dict(),
            "round_processors": [p.state_dict() for p in self.round_processors],
            "step_hooks": [h.state_dict() for h in self.step_hooks],
        }
        if hasattr(self.allocator, "state_dict"):
            out["allocator"] = self.allocator.state_dict()
        if self.batch_source is not None:
            out["batch_source"] = self.batch_source.state_dict()
        return out

    def load_state_dict(self, state: dict, rank0: bool = True) -> None:
        """Restore ``state_dict()`` (round processors exist on rank 0 only); a mismatch names what differs."""
        est = state.get("estimator")
        if (self.advantages.state is None) != (est is None):
            raise ValueError(
                f"checkpoint method state {'has' if est is not None else 'has no'} estimator state, "
                f"but advantage.estimator={self.advantages.name!r} "
                f"{'has' if self.advantages.state is not None else 'has no'} state"
            )
        if est is not None:
            self.advantages.state.load_state_dict(est)
        kinds = [("step_hooks", self.step_hooks)] + (
            [("round_processors", self.round_processors)] if rank0 else []
        )
        for kind, parts in kinds:
            saved = state.get(kind, [])
            if len(saved) != len(parts):
                raise ValueError(
                    f"checkpoint has {len(saved)} {kind.replace('_', ' ')}, this run has {len(parts)}"
                )
            for part, st in zip(parts, saved):
                part.load_state_dict(st)
        if rank0 and hasattr(self.allocator, "load_state_dict"):
            if "allocator" not in state:
                raise ValueError(
                    f"checkpoint method state has no allocator state, but this run's method has an "
                    f"allocator ({type(self.allocator).__name__})"
                )
            self.allocator.load_state_dict(state["allocator"])
        if self.batch_source is not None:  # the same on every rank
            if "batch_source" not in state:
                raise ValueError(
                    f"checkpoint method state has no batch source state, but this run's method has one "
                    f"({type(self.batch_source).__name__})"
                )
            self.batch_source.load_state_dict(state["batch_source"])


def _providers(wanted: dict[str, str]) -> list[tuple[Any, list[str]]]:
    """The providers of ``wanted`` in registration order, each with the names it must fill."""
    by_provider: dict[int, tuple[Any, list[str]]] = {}
    for name, who in wanted.items():
        p = provider_for(name, who)
        by_provider.setdefault(id(p), (p, []))[1].append(name)
    order = {id(p): i for i, p in enumerate(dict.fromkeys(INPUT_PROVIDERS.values()))}
    return sorted(by_provider.values(), key=lambda pn: order[id(pn[0])])
