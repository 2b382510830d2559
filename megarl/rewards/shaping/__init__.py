"""Method family 2, reward shaping and aggregation: RSPO (advantage estimator ``rspo``), the
rule-based reward floor, AMRP and Rubric Dropout (REWARD_SHAPERS, built from ``reward.shaping``)."""

from megarl.rewards.shaping import amrp, care, cedar, reward_floor, rrpo, rspo, rubric_dropout  # noqa: F401
from megarl.rewards.shaping.registry import REWARD_SHAPERS, build_reward_shaping

__all__ = ["REWARD_SHAPERS", "build_reward_shaping"]
