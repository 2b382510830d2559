"""``MethodSpec``: one method, registered by name, and the parts it contributes per run."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from megarl.batch import PackedBatch

Provenance = Literal["code", "paper", "reconstructed"]


@runtime_checkable
class StepHook(Protocol):
    """Around the optimizer steps of one RL step (every rank). ``before_train`` may return a
    modified batch (e.g. extra inputs of a second model); ``after_step`` returns metrics. Its
    ``state_dict`` goes in checkpoints (a critic's or a second policy's own state included)."""

    def before_train(self, step: int, batch: PackedBatch) -> PackedBatch: ...

    def after_step(self, step: int, metrics: dict) -> dict[str, float]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class PolicyGate(Protocol):
    """A step hook that may hold the policy still for an RL step (e.g. a critic's warm-up): when
    any hook's ``updates_policy(step)`` is False the trainer skips that step's policy optimizer
    steps; every hook's ``before_train`` and ``after_step`` (with empty metrics) still run."""

    def updates_policy(self, step: int) -> bool: ...


@runtime_checkable
class RolloutWeights(Protocol):
    """A step hook that changes the weights the rollout engine gets (parameter-space exploration):
    every weight sync of policy ``version`` runs inside ``rollout_weights(version)`` on every rank,
    a context that may change the learner's weights in place and must restore them exactly on exit
    (the optimizer and checkpoints only ever see the unchanged weights)."""

    def rollout_weights(self, version: int) -> AbstractContextManager: ...


@runtime_checkable
class BatchExtender(Protocol):
    """A step hook that appends sequences to the step's batch before its learner inputs are filled
    (e.g. samples of a second model for prompts the rollouts single out): ``extend_batch(step,
    batch, info)`` runs on every rank after the rollouts are packed, may make collective calls
    (weight pushes, broadcasts; the synchronous loop only) and returns the batch and its
    ``RolloutInfo`` with the same sequences appended to both (``info.answers``,
    ``info.reward_dims`` and ``info.extras`` cover every sequence; the runtime copies
    ``info.extras`` into ``batch.extras`` again). A hook that appends nothing returns both as given."""

    def extend_batch(self, step: int, batch: PackedBatch, info: Any) -> tuple[PackedBatch, Any]: ...


@runtime_checkable
class ShardedState(Protocol):
    """A step hook that owns a model (a critic, a second policy): its sharded state is saved in a
    folder of every run checkpoint and loaded from it on resume (both collective)."""

    def save_sharded(self, directory: Path) -> None: ...

    def load_sharded(self, directory: Path) -> None: ...


@runtime_checkable
class BatchSource(Protocol):
    """Each RL step's batch from somewhere other than the rollouts (offline or replayed episodes):
    ``next_batch(step)`` runs on every rank and must give every rank the same whole batch (its
    ``advantages`` filled or left to the estimator); its state (a cursor) goes in checkpoints."""

    def next_batch(self, step: int) -> PackedBatch: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class MethodParts:
    """What a method adds to a run beyond the registered objective parts it names in ``config``:
    rank 0's round processors (after the reward shaper) and step hooks, the run's rollout
    allocator (an ``Allocator`` or a ``StreamingAllocator``, megarl/plugin/allocation.py; None: the
    one ``sampling`` configures; its state is saved in checkpoints like a round processor's), and a
    ``BatchSource`` (None: the steps train on rollouts; else on its batches, and no rollouts are
    made for training); ``workflow_parts``: objects the rollout workflow may use (rank 0,
    ``WorkflowContext.parts``, e.g. a cross-episode memory; one that is also a round processor is
    checkpointed as one)."""

    round_processors: list[Any] = field(default_factory=list)
    step_hooks: list[Any] = field(default_factory=list)
    allocator: Any = None
    batch_source: Any = None
    workflow_parts: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MethodSpec:
    """A method.

    name: what ``method: {name: ...}`` says; summary: one line; provenance: where its formula
    comes from (``code``: the authors' code, ``paper``, ``reconstructed`` from the abstract);
    config: the config sections the method sets, e.g. ``{"advantage": {"estimator": "gepo"}}``
    (keys the user sets win: a knob left unset means the method's own default); register: called
    once when the spec is loaded, registers the method's objective parts and input providers;
    knobs: the dataclass of the method's own knobs (the ``method`` section's other keys);
    inputs: batch inputs the method needs beyond those its parts declare; build:
    ``build(ctx, knobs)`` -> ``MethodParts`` per run.
    """

    name: str
    summary: str
    provenance: Provenance
    config: dict = field(default_factory=dict)
    register: Callable[[], None] | None = None
    knobs: type | None = None
    inputs: tuple[str, ...] = ()
    build: Callable[..., MethodParts] | None = None
