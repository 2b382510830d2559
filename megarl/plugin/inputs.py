"""Batch inputs: one provider per input name, one registry.

A part declares the inputs it reads (``PartInfo.batch_inputs``, ``MethodSpec.inputs``); the trainer
asks ``INPUT_PROVIDERS`` for each and builds every provider once per run with the set of names it
must fill. A provider works at one stage of the step:

- ``learner``: every rank, after the batch is packed, with forward passes (the policy's old
  logprobs and entropies, a frozen reference, a teacher): ``LearnerPass.fill(batch, micro_batches)``;
- ``round``: rank 0, each rollout round after the rewards (scores made with the run's engines):
  a ``RoundProcessor`` (megarl/plugin/rounds.py) that adds per-sample ``extras``;
- ``batch``: every rank, on the packed batch and the rollouts' plain data (turn structure, answer
  checkpoints, reward dimensions): ``BatchFiller.fill(batch, info) -> metrics``.

A new input is one provider registered here, not an edit of the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from megarl.batch import PackedBatch

Stage = Literal["learner", "round", "batch"]


@dataclass
class RolloutInfo:
    """Plain per-sample data of the step's rollouts (same order as the batch's sequences)."""

    answers: Sequence[str]
    reward_dims: dict[str, Sequence[float]]
    extras: dict[str, Sequence[float]] = field(default_factory=dict)


class LearnerPass(Protocol):
    """Fills inputs with forward passes (collective: every rank calls it)."""

    def fill(self, batch: PackedBatch, micro_batches: int) -> dict[str, float]: ...


class BatchFiller(Protocol):
    """Fills inputs from the packed batch and the rollouts' plain data (every rank, deterministic)."""

    def fill(self, batch: PackedBatch, info: RolloutInfo) -> dict[str, float]: ...


@dataclass(frozen=True)
class InputProvider:
    """``build(ctx, names)`` -> a ``LearnerPass``, ``BatchFiller`` or ``RoundProcessor`` (by ``stage``)
    that fills ``names`` (a subset of ``provides``). ``knobs``: the dataclass of its knobs, set
    in the config as ``inputs.<name>``; ``rank0_only``: built on rank 0 only (round providers).
    ``moved_from``: (old dotted config key, knob) pairs of keys older configs wrote elsewhere; a
    config that still writes one is refused with a message naming ``inputs.<name>.<knob>``."""

    provides: tuple[str, ...]
    stage: Stage
    build: Callable[..., Any]
    knobs: type | None = None
    summary: str = ""
    moved_from: tuple[tuple[str, str], ...] = ()


INPUT_PROVIDERS: dict[str, InputProvider] = {}


def register_provider(p: InputProvider) -> InputProvider:
    """Register ``p`` for each name it provides (a name has one provider)."""
    for name in p.provides:
        if name in INPUT_PROVIDERS and INPUT_PROVIDERS[name] is not p:
            raise ValueError(f"batch input {name!r} already has a provider")
        INPUT_PROVIDERS[name] = p
    return p


def provider_for(name: str, needed_by: str = "") -> InputProvider:
    """The provider of ``name``; the error lists the known inputs and who asked."""
    try:
        return INPUT_PROVIDERS[name]
    except KeyError:
        who = f" (needed by {needed_by})" if needed_by else ""
        raise ValueError(
            f"no provider for batch input {name!r}{who}; known inputs: {', '.join(sorted(INPUT_PROVIDERS))}"
        ) from None
