"""The streaming allocation seam: what a per-prompt allocator sees and decides.

The rollout collector's streaming scheduler (megarl/trainer/streaming.py) runs a step with a
``StreamingAllocator``: it opens prompts while the step's ``StepBudget`` allows, shows the allocator
each prompt's outcomes as its samples land (``PromptView``) and carries out its decision: a target
number of samples for the prompt (``n`` commits the group) or ``ABANDON``. A method contributes its
allocator through ``MethodParts.allocator`` (docs/allocation.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

ABANDON = -1  # a streaming allocator's decision: drop the prompt, abort its requests in flight


@dataclass(frozen=True)
class PromptView:
    """What a streaming allocator sees of one prompt of the step.

    uid: its dataset row; slot: the order it was opened in this step; outcomes: 1.0 / 0.0 per
    landed sample, in the order the samples were issued (the correctness check's verdict, or
    reward > 0 when the run has none); rewards: the samples' scalar rewards (before shaping) in the
    same order; n: the group size a committed prompt gets.
    """

    uid: int
    slot: int
    outcomes: tuple[float, ...]
    rewards: tuple[float, ...]
    n: int


@dataclass(frozen=True)
class StepBudget:
    """The most one step may spend: ``samples`` (issued samples) and ``tokens`` (generated tokens;
    an issued sample is charged ``max_new_tokens`` until it lands; None: no token budget)."""

    samples: int
    tokens: int | None = None


@runtime_checkable
class StreamingAllocator(Protocol):
    """Per-prompt decisions within a step budget (see the module docstring).

    ``decide`` must depend only on the view and on state changed by ``end_step`` (never on timing),
    so that a resumed run makes the same decisions. ``decide`` runs after each request lands (in
    issue order); with ``request_size`` smaller than a decision's new samples it can run while the
    prompt still has requests in flight, and ``ABANDON`` then aborts them. ``end_step`` gets every
    prompt the step opened as ``(view, committed)`` and updates the allocator's history; its state
    goes in checkpoints.
    """

    want: int
    request_size: int  # samples per engine request (0: one request per decision)

    def budget(self, n: int, max_new_tokens: int) -> StepBudget:
        """The step's budget for groups of ``n`` samples of at most ``max_new_tokens`` tokens."""
        ...

    def decide(self, view: PromptView) -> int:
        """The prompt's target number of samples (> landed, <= n; n commits) or ``ABANDON``."""
        ...

    def end_step(self, step: int, prompts: list[tuple[PromptView, bool]]) -> dict[str, float]:
        """Update the history with the step's prompts (committed or not); return metrics."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass(frozen=True)
class GroupOutcome:
    """One group of a round as a curriculum sees it: the prompt's row id and task, its rewards
    (after shaping: what the advantages see)."""

    uid: int
    task: str
    rewards: tuple[float, ...]


@runtime_checkable
class PromptChooser(Protocol):
    """A round allocator that picks the step's prompts itself (a curriculum over tasks) instead of
    the run's shuffled sampler. ``bind`` gets every dataset row's task once, before the first step;
    ``next_prompts(step, count)`` returns ``count`` row ids; ``observe`` gets each round's groups and
    returns metrics. Its choices must depend only on its state and ``step`` (seeded draws), so that a
    resumed run picks the same prompts; its state goes in checkpoints."""

    def bind(self, tasks: list[str], seed: int) -> None: ...

    def next_prompts(self, step: int, count: int) -> list[int]: ...

    def observe(self, step: int, groups: list[GroupOutcome]) -> dict[str, float]: ...


@dataclass(frozen=True)
class PrefixView:
    """What a prefix allocator sees of one prompt after its ``n`` short prefixes landed.

    uid: its dataset row; slot: its position in the step; prefixes / logprobs: each prefix's token
    ids and the engine's logprobs of them; finished: whether the prefix already ended (a stop, not
    its length limit: it needs no continuation); n: the number of prefixes; max_new_tokens: the
    run's sample length limit (a continuation may add ``max_new_tokens - len(prefix)`` tokens)."""

    uid: int
    slot: int
    prefixes: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]
    finished: tuple[bool, ...]
    n: int
    max_new_tokens: int


@dataclass(frozen=True)
class Continuation:
    """A prefix allocator's decision for one prompt: ``keep[i]`` puts sample i in the batch (an
    unfinished kept prefix is continued on the engine from its prefix; the others are dropped);
    ``extras``: name -> one value per prefix, carried into the batch (``batch.extras[name]``) with
    the kept samples (e.g. their inclusion probabilities)."""

    keep: tuple[bool, ...]
    extras: dict[str, tuple[float, ...]] = field(default_factory=dict)


@runtime_checkable
class PrefixAllocator(Protocol):
    """Prefix-then-continue: each of the step's ``want`` prompts gets ``n`` prefixes of at most
    ``prefix_tokens`` tokens; ``choose`` decides which samples the batch keeps; the kept unfinished
    prefixes are continued on the engine (same tokens, no re-sampling of the prefix). Groups then
    hold the kept samples only (fewer than ``n``; a group with fewer than 2 is dropped). ``choose``
    may draw at random only from a generator seeded by (``step``, the view): a resumed run must
    decide the same. ``end_step`` gets each prompt's view, decision, and the kept samples' rewards
    and token counts (in kept order; empty for a dropped prompt); its state goes in checkpoints."""

    want: int
    prefix_tokens: int

    def choose(self, step: int, view: PrefixView) -> Continuation: ...

    def end_step(
        self,
        step: int,
        prompts: list[tuple[PrefixView, Continuation, tuple[float, ...], tuple[int, ...]]],
    ) -> dict[str, float]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...
