"""``RoundShaper``: the base of every reward shaper (what ``ShapingProcessor`` calls)."""

from __future__ import annotations

from typing import Any, ClassVar

from megarl.plugin.rounds import RolloutRound, RoundResult


class RoundShaper:
    """A reward shaper over one rollout round. ``needs_judge``: the processor gives it an
    ``LLMJudge`` over the run's engine; ``check_weights`` may refuse the reward weights."""

    needs_judge: ClassVar[bool] = False

    def check_weights(self, weights: dict[str, float]) -> None:
        """Refuse reward-function weights the shaper cannot use (``ValueError`` naming them)."""

    async def shape_round(self, r: RolloutRound, env: Any) -> RoundResult:
        """The round's shaped scalar rewards [G * n] and diagnostics."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """State kept across steps and checkpoints ({} when none)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``."""
