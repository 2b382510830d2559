"""Reward shaping and aggregation: the rule-based reward floor, AMRP, Rubric Dropout, CEDAR and
CARE (REWARD_SHAPERS, built from ``reward.shaping``), each with ``shape_round`` over one rollout
round; ``ShapingProcessor`` applies the configured one as a round processor."""

from megarl.rewards.shaping import amrp, care, cedar, reward_floor, rubric_dropout  # noqa: F401
from megarl.rewards.shaping.registry import REWARD_SHAPERS, build_reward_shaping

__all__ = ["REWARD_SHAPERS", "build_reward_shaping"]
