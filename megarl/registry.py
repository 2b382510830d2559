"""A small name -> callable registry, so a config can say ``policy_loss: gspo``.

Every entry carries a typed ``PartInfo``: what the part needs from the batch, whether it keeps
state across steps, and the capabilities the composed objective calls it with. The trainer reads
these fields; nothing looks for attributes on the function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class PartInfo:
    """What a registered part declares about itself.

    batch_inputs: names of the batch inputs the part reads (``entropies``, ``ref_logprobs``,
        ``steps``, ...); the trainer fills each through its provider (megarl/plugin/inputs.py).
    make_state: ``make_state(**knobs) -> state`` for parts that keep state across steps (saved in
        checkpoints through the state's ``state_dict``/``load_state_dict``).
    prepare: ``prepare(batch, dp_group, state, **knobs) -> batch``, run once per optimizer step on
        the DP rank's whole batch (global statistics before micro-batching).
    token_metrics: per-token diagnostics of a policy loss, same arguments as the loss.
    needs_context: the part takes ``batch=`` and ``ctx=`` keywords.
    needs_entropy: the part takes the current policy's full-vocab entropy as ``entropy=``.
    reads_logits: a distillation term or regulariser that reads its ``logits`` argument (the
        full-vocabulary logits); False lets the learner fuse the output layer (``logits`` is None).
    aggregates_itself: a regulariser that returns its globally normalised scalar itself.
    group_relative: an advantage estimator that scores each sample against the other samples of its
        prompt's group, so a group of one sample gets advantage 0 (the config refuses rollout.n=1).
    heads: output heads the part reads from ``LossContext.heads``; the run builds the policy with
        them (scalar heads on its trunk, trained through the same backward: megarl/learner/heads.py).
    """

    batch_inputs: tuple[str, ...] = ()
    make_state: Callable[..., Any] | None = None
    prepare: Callable[..., Any] | None = None
    token_metrics: Callable[..., Any] | None = None
    needs_context: bool = False
    needs_entropy: bool = False
    reads_logits: bool = True
    aggregates_itself: bool = False
    group_relative: bool = False
    heads: tuple[str, ...] = ()


class Registry(Generic[F]):
    """Named callables of one kind (policy losses, advantage estimators, ...)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, F] = {}
        self._info: dict[str, PartInfo] = {}

    def register(self, name: str, **info: Any) -> Callable[[F], F]:
        """Decorator: register ``fn`` under ``name`` with its ``PartInfo`` fields as keywords
        (a name may be registered once)."""

        def deco(fn: F) -> F:
            self.add(name, fn, PartInfo(**info))
            return fn

        return deco

    def add(self, name: str, fn: F, info: PartInfo | None = None) -> None:
        """Register ``fn`` under ``name`` (not as a decorator)."""
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = fn
        self._info[name] = info or PartInfo()

    def get(self, name: str) -> F:
        """The callable registered as ``name``; a KeyError lists the allowed names."""
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(
                f"unknown {self.kind} {name!r}; allowed: {', '.join(sorted(self._items))}"
            ) from None

    def info(self, name: str) -> PartInfo:
        """The ``PartInfo`` of ``name`` (a KeyError lists the allowed names)."""
        self.get(name)
        return self._info[name]

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items
