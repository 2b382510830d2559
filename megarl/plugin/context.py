"""What the run offers a part when the part is built (``RunContext``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class RunContext:
    """One per run, on every rank; the rank-0-only fields are None elsewhere.

    cfg: the run's ``TrainConfig``; knobs: the knobs of the part being built (``inputs.<name>``
    for an input provider, the ``method`` section's knobs for a method); make_learner:
    ``make_learner(hf_config, weights_dir, trainable=False)`` -> a learner under the run's layout;
    init_dir: the initial policy (HF safetensors); engine: rank 0's rollout engine; score:
    ``score(texts, answers)`` -> the run's reward result (named dims, weighted scalar); sampling:
    ``sampling(step, round, index)`` -> the run's seeded ``SamplingParams``; groups: the run's
    process groups (a part that builds its own model under the run's layout); dp_share:
    ``dp_share(batch)`` -> this data-parallel replica's share of whole groups; dp_group: the
    data-parallel group (None with one replica); push_weights: ``push_weights(label, learner=None)``
    pushes the policy learner's (or ``learner``'s: a second trainable model of the same
    architecture that a part builds with ``make_learner``) current weights to rank 0's engine under
    version ``label`` (collective: every rank calls it; the synchronous loop only); run_coroutine:
    ``run_coroutine(coro)`` runs a coroutine (e.g. engine calls) to completion on the loop rank 0's
    engine is driven by; dataset: the run's training prompts (a ``PromptDataset``: ``rows`` of
    prompt text and answer), for parts that sample prompts themselves.
    """

    cfg: Any
    tokenizer: Any
    hf_config: dict
    rank0: bool
    init_dir: Path
    make_learner: Callable[..., Any]
    policy: Any = None
    engine: Any = None
    score: Callable[[list[str], list[str]], Any] | None = None
    sampling: Callable[..., Any] | None = None
    knobs: Any = None
    groups: Any = None
    dp_share: Callable[[Any], Any] | None = None
    dp_group: Any = None
    push_weights: Callable[[str], None] | None = None
    run_coroutine: Callable[[Any], Any] | None = None
    dataset: Any = None

    def with_knobs(self, knobs: Any) -> RunContext:
        """A copy of this context carrying ``knobs`` (a part's knobs dataclass, or None)."""
        return dataclasses.replace(self, knobs=knobs)
