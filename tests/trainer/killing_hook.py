"""A method plugin for the kill-and-resume tests: a step hook that SIGKILLs the run's process group
when the policy of step ``MEGARL_TEST_KILL_AT_STEP`` is pushed to the rollout engine (after that
step's update, before its checkpoint), so the kill lands inside a step however fast the steps are,
and also when the step made no update. Without the variable it does nothing. ``SPEC`` changes no
config (the run is the configured one); ``SARA`` and ``PAIR`` are those built-in methods with the
hook added after their own."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
from collections.abc import Iterator

from megarl.batch import PackedBatch
from megarl.catalogue import method_spec
from megarl.plugin.spec import MethodParts, MethodSpec


class KillAtStep:
    """A ``RolloutWeights`` step hook that kills its own process group at the weight sync of the
    step named in the environment; otherwise it leaves the batch, weights and metrics alone."""

    def __init__(self) -> None:
        at = os.environ.get("MEGARL_TEST_KILL_AT_STEP")
        self.step = int(at) if at else None

    @contextlib.contextmanager
    def rollout_weights(self, version: int) -> Iterator[None]:
        if version == self.step:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        yield

    def before_train(self, step: int, batch: PackedBatch) -> PackedBatch:
        return batch

    def after_step(self, step: int, metrics: dict) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _with_killer(parts: MethodParts) -> MethodParts:
    parts.step_hooks.append(KillAtStep())
    return parts


SPEC = MethodSpec(
    name="kill_at_step",
    summary="test plugin: SIGKILL the run inside a chosen step",
    provenance="code",
    build=lambda ctx, knobs: _with_killer(MethodParts()),
)


def with_killer(name: str) -> MethodSpec:
    """Built-in method ``name`` (registered here) with a ``KillAtStep`` hook after its own."""
    spec = method_spec({"name": name})

    def build(ctx, knobs) -> MethodParts:
        return _with_killer(spec.build(ctx, knobs) if spec.build is not None else MethodParts())

    return dataclasses.replace(spec, register=None, build=build)


SARA = with_killer("sara")
PAIR = with_killer("pair")
