"""Which reward dimension decides whether an answer is correct.

Accuracy (held-out pass@k, the training samples' accuracy, the retry workflow's "wrong answer,
try again") comes from one verifier, never from a threshold on the weighted sum: with a format
reward beside the answer check, a well-formatted wrong answer can reach any such threshold. The
verifier is the reward entry marked ``correct: true``, or the only entry when there is one; an
answer is correct when that verifier gives at least ``CORRECT_VALUE``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CORRECT_VALUE = 1.0  # a verifier's value for a correct answer (exact_match, regex, math_verify give 0 or 1)


def correctness_index(functions: Sequence[Any]) -> int:
    """Index in ``functions`` (``RewardFunctionConfig``-like: ``name``, ``correct``) of the reward
    that decides correctness. Raises ``ValueError`` naming ``reward.functions[i].correct`` when
    several rewards are given and none, or more than one, is marked."""
    marked = [i for i, f in enumerate(functions) if getattr(f, "correct", False)]
    names = [f.name for f in functions]
    if len(marked) > 1:
        keys = ", ".join(f"reward.functions[{i}].correct ({names[i]!r})" for i in marked)
        raise ValueError(f"{keys}: only one reward may be the correctness check")
    if marked:
        return marked[0]
    if len(functions) == 1:
        return 0
    raise ValueError(
        f"reward.functions has {len(functions)} rewards {names} and none is marked as the correctness "
        "check: set `correct: true` on the one that verifies the answer (e.g. "
        f"reward.functions[0].correct: true for {names[0]!r}); accuracy is measured with it, not "
        "with the weighted sum"
    )
